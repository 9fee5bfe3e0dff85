"""A conversation's prompt, which every chat-shaped surface shares (chat completions, Responses, Messages): the chat
template with the tools in play, the request's template variables, tool_choice's mode, and the grammar the answer
must follow (structured output, a required call)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculant.config import StructuredOutputsParams
from speculant.errors import SpeculantError
from speculant.server.http.errors import APIError
from speculant.structured.tools import ToolFormat

if TYPE_CHECKING:
    from speculant.server.bridge.core import OpenAIServer


def template_kwargs(kwargs: dict | None, enable_thinking: bool | None) -> dict | None:
    """A request's chat_template_kwargs, with its top-level enable_thinking where it gives one (the two must
    agree); raises ValueError where they do not."""
    out = dict(kwargs or {})
    if enable_thinking is not None:
        if out.get("enable_thinking", enable_thinking) != enable_thinking:
            raise ValueError("enable_thinking and chat_template_kwargs.enable_thinking disagree")
        out["enable_thinking"] = enable_thinking
    return out or None


def tool_mode(names: list[str], choice: str | None) -> str | None:
    """None (no tools in play), "auto", "required" or the name of the function that must be called, for tools
    `names` and a tool_choice ("none", "auto", "required", a function's name, or None); raises ValueError naming
    a tool_choice that cannot be honoured."""
    if len(set(names)) < len(names):
        raise ValueError("tools: two tools share a function name")
    if choice not in (None, "none", "auto", "required"):
        if choice not in names:
            raise ValueError(f"tool_choice names the function '{choice}', which is not in tools")
        return choice
    if not names or choice == "none":
        if choice == "required":
            raise ValueError("tool_choice 'required' needs tools")
        return None
    return choice or "auto"


def request_template_kwargs(kwargs: dict | None, enable_thinking: bool | None) -> dict | None:
    try:
        return template_kwargs(kwargs, enable_thinking)
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None


async def chat_prompt(server: OpenAIServer, messages: list[dict], mode: str | None, tool_specs: list[dict],
                      tools: ToolFormat, param: str, add_generation_prompt: bool = True,
                      template_kwargs: dict | None = None) -> list[int]:
    """The conversation through the chat template, the tools (OpenAI tool objects) in play when `mode` is, and
    the request's own template variables (chat_template_kwargs)."""
    functions = [t["function"] for t in tool_specs] if mode else None
    messages = tools.messages_for_template(messages, functions, auto=mode == "auto")
    rendered = tool_specs if mode and tools.template_renders_tools else None
    try:
        return await server.off_loop(server.tokenizer.encode_chat, messages, rendered, add_generation_prompt,
                                     template_kwargs)
    except SpeculantError as e:
        raise APIError(400, str(e), param=param) from None


async def structured_output(server: OpenAIServer, wanted: StructuredOutputsParams | None, mode: str | None,
                            functions: list[dict], parallel: bool, tools: ToolFormat,
                            format_param: str) -> StructuredOutputsParams | None:
    """The grammar the answer must follow: the asked format's (`wanted`), or a call for tool_choice "required"
    or a named function; compiled here (a bad schema is this request's 400, and the engine finds it cached)."""
    param = format_param
    if wanted is not None and mode is not None:
        raise APIError(400, f"{format_param} (json_object, json_schema) with tools is not supported: the answer "
                            f"could not be both; send tool_choice 'none' or no {format_param}", param=format_param)
    if mode == "required":
        wanted, param = tools.constraint(functions, parallel), "tools"
    elif mode not in (None, "auto"):
        named = [f for f in functions if f["name"] == mode]
        wanted, param = tools.constraint(named, False), "tools"
    if wanted is None:
        return None
    try:
        await server.off_loop(server.engine.grammars.compile, wanted)
    except SpeculantError as e:
        raise APIError(400, str(e), param=param) from None
    return wanted
