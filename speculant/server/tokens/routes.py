"""POST /tokenize and POST /detokenize, in vLLM's shapes (llama.cpp's server has the same pair): what a client
needs to count a prompt's tokens, or read token ids back as text, with this model's own tokenizer and chat
template."""

from __future__ import annotations

from fastapi import APIRouter, Request

from speculant.server.bridge.core import OpenAIServer
from speculant.server.chat.prompt import chat_prompt
from speculant.server.http.errors import ERROR_RESPONSES, APIError, parse_json
from speculant.server.tokens.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from speculant.structured.tools import tool_format

router = APIRouter()


@router.post("/tokenize", responses=ERROR_RESPONSES, response_model=TokenizeResponse)
async def tokenize(request: Request) -> TokenizeResponse:
    server: OpenAIServer = request.app.state.server
    req = await parse_json(request, TokenizeRequest)
    server.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    server.need_tokenizer("prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        ids = await server.off_loop(server.tokenizer.encode, req.prompt, req.add_special_tokens)
    else:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        ids = await chat_prompt(server, [m.for_template() for m in req.messages], "auto" if tools else None, tools,
                                tool_format(server.tokenizer.chat_template), "messages", req.add_generation_prompt,
                                req.chat_template_kwargs)
    return TokenizeResponse(count=len(ids), max_model_len=server.engine.max_model_len, tokens=ids)


@router.post("/detokenize", responses=ERROR_RESPONSES, response_model=DetokenizeResponse)
async def detokenize(request: Request) -> DetokenizeResponse:
    server: OpenAIServer = request.app.state.server
    req = await parse_json(request, DetokenizeRequest)
    server.check_model(req.model)
    server.need_tokenizer("tokens")
    vocab = server.engine.model.cfg.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of the vocabulary [0, {vocab})", param="tokens")
    text = await server.off_loop(lambda: server.tokenizer.decode(req.tokens, skip_special_tokens=False))
    return DetokenizeResponse(prompt=text)
