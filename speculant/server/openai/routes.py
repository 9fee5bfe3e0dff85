"""POST /v1/completions and POST /v1/chat/completions. Chat's prompt (template, tools) and structured output
come from chat/prompt.py, which the Responses and Messages APIs share."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from speculant.server.bridge.core import OpenAIServer
from speculant.server.chat.prompt import chat_prompt, request_template_kwargs, structured_output
from speculant.server.http.errors import ERROR_RESPONSES, APIError, parse_body
from speculant.server.openai.formats import ChatFormat, CompletionFormat, Echo
from speculant.server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from speculant.structured.tools import tool_format

router = APIRouter()


@router.post("/v1/completions", responses=ERROR_RESPONSES, response_model=CompletionResponse)
async def completions(request: Request) -> Response:
    server: OpenAIServer = request.app.state.server
    req = await parse_body(request, CompletionRequest)
    server.check_model(req.model)
    if req.echo and req.n > 1:
        raise APIError(400, "echo with n > 1 is not supported (each choice would repeat the prompt)", param="echo")
    if req.max_tokens == 0 and req.prompt_top_wanted() is None:
        raise APIError(400, "max_tokens 0 writes nothing: it is allowed only to score the prompt (echo with "
                            "logprobs, or prompt_logprobs)", param="max_tokens")
    server.check_sequences(req.prompt_count(), req.n, "prompt")
    prompts = await completion_prompts(server, req.prompt)
    for ids in prompts:
        server.check_context(ids, req.max_new_tokens(), "prompt")
    server.check_work(prompts, req)
    echo = Echo(await echo_texts(server, req.prompt, prompts), req.logprobs) if req.echo else None
    fmt = CompletionFormat(server.token_text, echo, prompts, req.n, req.prompt_logprobs)
    return await server.generate(request, req, prompts, fmt)


async def echo_texts(server: OpenAIServer, prompt: str | list, prompts: list[list[int]]) -> list[str]:
    """The prompts as echo writes them back: as sent where they came as text, else decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        return list(prompt)
    if server.tokenizer is None:
        return ["".join(server.token_text(t) for t in ids) for ids in prompts]
    return await server.off_loop(lambda: [server.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts])


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES, response_model=ChatCompletionResponse)
async def chat_completions(request: Request) -> Response:
    server: OpenAIServer = request.app.state.server
    req = await parse_body(request, ChatCompletionRequest)
    server.check_model(req.model)
    server.need_chat_template("messages")
    server.check_sequences(1, req.n, "n")
    try:
        mode = req.tool_mode()
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    tools = tool_format(server.tokenizer.chat_template)
    wanted = req.response_format.structured() if req.response_format is not None else None
    structured = await structured_output(server, wanted, mode, req.functions(), req.parallel_tool_calls, tools,
                                         "response_format")
    specs = [t.model_dump(exclude_none=True) for t in req.tools or []]
    kwargs = request_template_kwargs(req.chat_template_kwargs, req.enable_thinking)
    ids = await chat_prompt(server, [m.for_template() for m in req.messages], mode, specs, tools, "messages",
                            template_kwargs=kwargs)
    server.check_context(ids, req.max_new_tokens(), "messages")
    server.check_work([ids], req)
    fmt = ChatFormat(server.token_text, tools if mode else None, ids, req.prompt_logprobs,
                     server.reasoning_for(ids, structured), server.tokenizer.decode)
    return await server.generate(request, req, [ids], fmt, structured)


async def completion_prompts(server: OpenAIServer, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return [prompt]
    if isinstance(prompt, list) and isinstance(prompt[0], list):
        return prompt
    server.need_tokenizer("prompt")
    texts = [prompt] if isinstance(prompt, str) else prompt
    return await server.off_loop(lambda: [server.tokenizer.encode(p) for p in texts])
