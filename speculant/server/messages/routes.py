"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over chat's machinery.

A request's system prompt and messages (text, tool_use and tool_result blocks) become chat messages and go
through the chat template as a chat completion's do (chat/prompt.py: the same tool prompt, the same grammars, a
tool's input exact under speculation), so an agent's growing conversation reads its prefix from the prefix
cache. tool_choice `any` and `tool` are chat's `required` and a named function; `thinking` switches the
template's thought (enable_thinking) and a thinking model's thought leaves as thinking blocks (reasoning.py).
Errors leave in Anthropic's shape (http/guard.py: anthropic_error), with the statuses its SDK maps.
"""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from speculant.server.bridge.core import OpenAIServer
from speculant.server.chat.prompt import chat_prompt, structured_output, tool_mode
from speculant.server.http.errors import ERROR_RESPONSES, APIError, parse_json
from speculant.server.messages.answer import Prompt, answer
from speculant.server.messages.protocol import (
    CountTokensRequest,
    ErrorBody,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from speculant.server.messages.stream import stream_events
from speculant.structured.tools import tool_format

router = APIRouter()

BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
          "redacted_thinking": ThinkingBlock}
# The statuses every route declares, with Anthropic's error body.
ERRORS = {status: {**declared, "model": ErrorBody} for status, declared in ERROR_RESPONSES.items()}


def first_error(e: ValidationError, where: str, param: str) -> APIError:
    first = e.errors()[0]
    at = ".".join([where] + [str(p) for p in first["loc"]])
    return APIError(400, f"{at}: {first['msg']}", param=param)


def blocks(content: str | list[dict], where: str) -> list[BaseModel]:
    """A message's content as blocks; an image, a document or any other kind is a 400 that names it."""
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    out = []
    for j, raw in enumerate(content):
        kind = raw.get("type")
        model = BLOCKS.get(kind)
        if model is None:
            raise APIError(400, f"{where}.content[{j}]: content blocks of type {kind!r} are not supported by this "
                                f"server (text, tool_use, tool_result and thinking are)", param="messages")
        try:
            out.append(model.model_validate(raw))
        except ValidationError as e:
            raise first_error(e, f"{where}.content[{j}]", "messages") from None
    return out


def tool_input_text(block: ToolUseBlock) -> str:
    return json.dumps(block.input, ensure_ascii=False)


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The system prompt and messages as chat messages: an assistant's tool_use blocks its tool_calls, a user's
    tool_result blocks tool messages (each answering a tool_use before it), thoughts sent back left out."""
    system = req.system_text()
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        parsed = blocks(m.content, where)
        wrong = next((b for b in parsed if isinstance(b, ToolResultBlock if m.role == "assistant" else ToolUseBlock)),
                     None)
        if wrong is not None:
            raise APIError(400, f"{where}: a {m.role} message cannot hold {wrong.type} blocks", param="messages")
        if m.role == "assistant":
            said = {"role": "assistant", "content": "".join(b.text for b in parsed if isinstance(b, TextBlock))}
            uses = [b for b in parsed if isinstance(b, ToolUseBlock)]
            if uses:
                said["tool_calls"] = [{"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": tool_input_text(b)}} for b in uses]
                calls |= {b.id for b in uses}
            out.append(said)
            continue
        text: list[str] = []
        for b in parsed:
            if isinstance(b, TextBlock):
                text.append(b.text)
            elif isinstance(b, ToolResultBlock):
                if b.tool_use_id not in calls:
                    raise APIError(400, f"{where}: tool_result answers tool_use_id '{b.tool_use_id}', which no "
                                        f"tool_use before it made", param="messages")
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        if text or not any(isinstance(b, ToolResultBlock) for b in parsed):
            out.append({"role": "user", "content": "".join(text)})
    if req.messages[-1].role == "assistant":
        raise APIError(400, "the last message is the assistant's: continuing a prefilled answer is not supported "
                            "by this server (end with a user message)", param="messages")
    return out


def custom_tools(tools: list[dict] | None) -> list[Tool]:
    others = sorted({str(t.get("type")) for t in tools or [] if t.get("type") not in (None, "custom")})
    if others:
        raise APIError(400, f"tools of type {', '.join(repr(t) for t in others)} are not supported by this server: "
                            f"only custom tools (name, description, input_schema) run here", param="tools")
    out = []
    for i, t in enumerate(tools or []):
        try:
            out.append(Tool.model_validate(t))
        except ValidationError as e:
            raise first_error(e, f"tools[{i}]", "tools") from None
    return out


async def prompt(server: OpenAIServer, req: CountTokensRequest, compile_grammar: bool = True) -> Prompt:
    server.check_model(req.model)
    server.need_chat_template("messages")
    tools = custom_tools(req.tools)
    try:
        mode = tool_mode([t.name for t in tools], req.tool_choice.mode() if req.tool_choice else None)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    fmt = tool_format(server.tokenizer.chat_template)
    specs = [t.spec() for t in tools]
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    wanted = req.output_config.structured() if req.output_config is not None else None
    structured = await structured_output(server, wanted, mode, [s["function"] for s in specs], parallel, fmt,
                                         "output_config.format") if compile_grammar else None
    thinking = None if req.thinking is None else {"enable_thinking": req.thinking.type != "disabled"}
    ids = await chat_prompt(server, chat_messages(req), mode, specs, fmt, "messages", template_kwargs=thinking)
    return Prompt(ids, fmt if mode else None, structured, server.reasoning_for(ids, structured))


@router.post("/v1/messages/count_tokens", responses=ERRORS, response_model=TokenCount)
async def count_tokens(request: Request) -> TokenCount:
    server: OpenAIServer = request.app.state.server
    req = await parse_json(request, CountTokensRequest)
    return TokenCount(input_tokens=len((await prompt(server, req, compile_grammar=False)).ids))


@router.post("/v1/messages", responses=ERRORS, response_model=Message)
async def create_message(request: Request) -> Response:
    server: OpenAIServer = request.app.state.server
    req = await parse_json(request, MessagesRequest)
    p = await prompt(server, req)
    server.check_context(p.ids, req.max_tokens, "messages")
    server.check_work([p.ids], req)
    stream = await server.start(f"msg_{uuid.uuid4().hex}", req, [p.ids], p.structured, request)
    if req.stream:
        return StreamingResponse(stream_events(server, req, p, stream), media_type="text/event-stream",
                                 background=BackgroundTask(stream.close))
    answers = await server.collect(request, stream, req)
    if answers is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(answer(server, req, p, stream, answers[0]).model_dump())


