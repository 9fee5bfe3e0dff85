"""The OpenAI-compatible HTTP API over one engine.

POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.
Requests first pass the guard (guard.py: host, key, content type, body size and time). Handlers validate,
tokenize (in a thread: the event loop keeps answering) and hand the request to the engine thread
(worker.py); they never touch the engine themselves. Every error leaves as the OpenAI error body with a
4xx/5xx status; a 5xx says only which request failed, the log says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculant.config import StructuredOutputsParams
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.sequence import Sequence, SpecStats
from speculant.server.guard import RequestGuard, ServerLimits, allowed_host_names, header_timeout_protocol
from speculant.server.metrics import ServerMetrics
from speculant.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    FunctionCallDelta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    SpeculativeStats,
    TokenLogprobInfo,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
)
from speculant.server.worker import (
    Delta,
    EngineFailure,
    EngineWorker,
    Overloaded,
    RequestStream,
    RequestTimedOut,
    ShuttingDown,
)
from speculant.structured.tools import ToolCallStream, ToolFormat, tool_format

log = logging.getLogger("speculant.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=err.info).model_dump(), status_code=err.status, headers=headers)


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"internal server error (request id {request_id}); the server log has the details",
                    "internal_error")


def api_error(e: Exception, request_id: str) -> APIError:
    """The HTTP face of an error raised while a request was with the engine."""
    if isinstance(e, SpeculantError):
        return APIError(400, str(e))
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, Overloaded):
        return APIError(429, str(e), "rate_limit_error", code="server_busy",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, RequestTimedOut):
        return APIError(408, str(e), "timeout_error", code="request_timeout")
    if not isinstance(e, EngineFailure):
        log.error("request %s failed", request_id, exc_info=(type(e), e, e.__traceback__))
    return internal_error(request_id)


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def parse_body(request: Request, model: type[SamplingRequest]) -> SamplingRequest:
    try:
        req = model.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        if not loc:  # the body itself: not JSON, or not an object
            raise APIError(400, f"invalid request body: {first['msg']}") from None
        raise APIError(400, f"{'.'.join(loc)}: {first['msg']}", param=loc[0]) from None
    unsupported = req.unsupported()
    if unsupported:
        raise APIError(400, f"'{unsupported}' is not supported by this server (refused rather than ignored)",
                       param=unsupported)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return req


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sum_stats(seqs: list[Sequence]) -> SpecStats:
    return sum((s.stats for s in seqs), SpecStats())


# -- the two response families ----------------------------------------------------------------


class CompletionFormat:
    """Completions' shapes. One instance serves one request (it counts text offsets per choice)."""

    id_prefix = "cmpl"

    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text
        self.offsets: dict[int, int] = {}

    def logprobs(self, d: Delta) -> CompletionLogprobs | None:
        if d.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in d.token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(self.offsets.get(d.index, 0))
            self.offsets[d.index] = offsets[-1] + len(tok)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in d.logprobs],
                                  top_logprobs=[{self.token_text(t): v for t, v in lp.top} for lp in d.logprobs],
                                  text_offset=offsets)

    def response(self, rid: str, model: str, choices: list[Delta], with_ids: bool, **extra) -> BaseModel:
        return CompletionResponse(id=rid, model=model, choices=self.choices(choices, with_ids), **extra)

    def opening(self, rid: str, created: int, model: str, n: int) -> list[BaseModel]:
        return []

    def chunk(self, rid: str, created: int, model: str, deltas: list[Delta], with_ids: bool,
              **extra) -> BaseModel:
        return CompletionResponse(id=rid, created=created, model=model, choices=self.choices(deltas, with_ids),
                                  **extra)

    def choices(self, deltas: list[Delta], with_ids: bool) -> list[CompletionChoice]:
        return [CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason,
                                 logprobs=self.logprobs(d), token_ids=d.token_ids if with_ids else None)
                for d in deltas]


class ChatFormat:
    """Chat's shapes. With `tools` (the tool format of a request whose tools are in play) an answer's calls
    leave as tool_calls, finish_reason "tool_calls"; a stream holds the text from where a call may begin."""

    id_prefix = "chatcmpl"

    def __init__(self, token_text: Callable[[int], str], tools: ToolFormat | None = None):
        self.token_text = token_text
        self.tools = tools
        self.streams: dict[int, ToolCallStream] = {}

    def logprobs(self, d: Delta) -> ChatLogprobs | None:
        if d.logprobs is None:
            return None

        def top(token: int, logprob: float) -> TopLogprob:
            text = self.token_text(token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            TokenLogprobInfo(**top(t, lp.logprob).model_dump(), top_logprobs=[top(a, v) for a, v in lp.top])
            for t, lp in zip(d.token_ids, d.logprobs, strict=True)])

    def response(self, rid: str, model: str, choices: list[Delta], with_ids: bool, **extra) -> BaseModel:
        out = []
        for d in choices:
            message, finish = AssistantMessage(content=d.text), d.finish_reason
            parsed = self.tools.parse(d.text) if self.tools is not None else None
            if parsed is not None:
                content, calls = parsed
                message = AssistantMessage(content=content, tool_calls=[ToolCall(**c) for c in calls])
                finish = calls_finish(finish)
            out.append(ChatChoice(index=d.index, message=message, finish_reason=finish, logprobs=self.logprobs(d),
                                  token_ids=d.token_ids if with_ids else None))
        return ChatCompletionResponse(id=rid, model=model, choices=out, **extra)

    def opening(self, rid: str, created: int, model: str, n: int) -> list[BaseModel]:
        # As OpenAI does: each choice's first chunk names the role, with empty content.
        return [ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]) for i in range(n)]

    def chunk(self, rid: str, created: int, model: str, deltas: list[Delta], with_ids: bool,
              **extra) -> BaseModel:
        choices = [ChatStreamChoice(index=d.index, delta=delta, finish_reason=finish, logprobs=self.logprobs(d),
                                    token_ids=d.token_ids if with_ids else None)
                   for d in deltas for delta, finish in [self.delta(d)]]
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **extra)

    def delta(self, d: Delta) -> tuple[DeltaMessage, str | None]:
        if self.tools is None:
            return DeltaMessage(content=d.text or None), d.finish_reason
        stream = self.streams.setdefault(d.index, ToolCallStream(self.tools))
        content, calls = stream.push(d.text), []
        if d.finish_reason is not None:
            rest, calls = stream.finish()
            content += rest
        tool_calls = [ToolCallDelta(index=i, id=c["id"], type="function",
                                    function=FunctionCallDelta(**c["function"])) for i, c in enumerate(calls)]
        finish = calls_finish(d.finish_reason) if calls else d.finish_reason
        return DeltaMessage(content=content or None, tool_calls=tool_calls or None), finish


def calls_finish(reason: str | None) -> str | None:
    """An answer that ended by itself with calls finishes as "tool_calls"; one cut short keeps its reason."""
    return "tool_calls" if reason == "stop" else reason


# -- the server -------------------------------------------------------------------------------


class OpenAIServer:
    def __init__(self, engine: Engine, served_model_names: list[str], limits: ServerLimits | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        self.model_name = served_model_names[0]
        self.limits = limits or ServerLimits()
        self.max_request_tokens = self.limits.max_request_tokens or engine.max_batch_size * engine.max_model_len
        self.metrics = ServerMetrics(self.model_name, engine.k)
        self.worker = EngineWorker(engine, self.metrics, self.limits.request_timeout_s,
                                   self.limits.max_waiting_requests)
        # Tokenization and template rendering: off the event loop, two at a time (the engine needs the rest).
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculant-tokenize")

    async def off_loop(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

    # -- endpoints --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        self.check_model(req.model)
        self.check_sequences(req.prompt_count(), req.n, "prompt")
        prompts = await self.completion_prompts(req.prompt)
        for ids in prompts:
            self.check_context(ids, req.max_new_tokens(), "prompt")
        self.check_work(prompts, req)
        return await self.generate(request, req, prompts, CompletionFormat(self.token_text))

    async def chat_completions(self, request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        self.check_model(req.model)
        self.need_tokenizer("messages")
        if not self.tokenizer.chat_template:  # before a grammar's compilation, a request's costliest check
            raise APIError(400, "this model has no chat template (a base model): send its prompt raw to "
                                "/v1/completions", param="messages")
        self.check_sequences(1, req.n, "n")
        try:
            mode = req.tool_mode()
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        tools = tool_format(self.tokenizer.chat_template)
        structured = await self.structured_output(req, mode, tools)
        functions = req.functions() if mode else None
        messages = tools.messages_for_template([m.for_template() for m in req.messages], functions)
        rendered = [t.model_dump(exclude_none=True) for t in req.tools] if mode and tools.template_renders_tools \
            else None
        try:
            ids = await self.off_loop(self.tokenizer.encode_chat, messages, rendered)
        except SpeculantError as e:
            raise APIError(400, str(e), param="messages") from None
        self.check_context(ids, req.max_new_tokens(), "messages")
        self.check_work([ids], req)
        return await self.generate(request, req, [ids], ChatFormat(self.token_text, tools if mode else None),
                                   structured)

    async def structured_output(self, req: ChatCompletionRequest, mode: str | None,
                                tools: ToolFormat) -> StructuredOutputsParams | None:
        """The grammar the answer must follow: response_format's, or a call for tool_choice "required" or a
        named function; compiled here (a bad schema is this request's 400, and the engine finds it cached)."""
        wanted = req.response_format.structured() if req.response_format is not None else None
        param = "response_format"
        if wanted is not None and mode is not None:
            raise APIError(400, "response_format (json_object, json_schema) with tools is not supported: the "
                                "answer could not be both; send tool_choice 'none' or no response_format",
                           param="response_format")
        if mode == "required":
            wanted, param = tools.constraint(req.functions(), req.parallel_tool_calls), "tools"
        elif mode not in (None, "auto"):
            named = [f for f in req.functions() if f["name"] == mode]
            wanted, param = tools.constraint(named, False), "tools"
        if wanted is None:
            return None
        try:
            await self.off_loop(self.engine.grammars.compile, wanted)
        except SpeculantError as e:
            raise APIError(400, str(e), param=param) from None
        return wanted

    def models(self) -> ModelList:
        # The name clients send, never the path the weights were loaded from.
        cards = [ModelCard(id=name, root=name, max_model_len=self.engine.max_model_len) for name in self.model_names]
        return ModelList(data=cards)

    def health(self) -> Response:
        if not self.worker.accepting:
            return error_response(APIError(503, "the server is shutting down", "service_unavailable"))
        return JSONResponse({"status": "ok"})

    def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    # -- checks and prompts -----------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}",
                           param="model", code="model_not_found")

    def token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return str(token)
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: only /v1/completions with a prompt of token ids "
                                "works", param=param)

    async def completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            return [prompt]
        if isinstance(prompt, list) and isinstance(prompt[0], list):
            return prompt
        self.need_tokenizer("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return await self.off_loop(lambda: [self.tokenizer.encode(p) for p in texts])

    def check_sequences(self, prompts: int, n: int, param: str) -> None:
        limit = self.limits.max_sequences
        if prompts * n > limit:
            raise APIError(400, f"this request asks for {prompts * n} sequences ({prompts} prompt(s) × n={n}); "
                                f"this server's limit is {limit} a request", param="n" if n > 1 else param,
                           code="too_many_sequences")

    def check_work(self, prompts: list[list[int]], req: SamplingRequest) -> None:
        """Prompt plus completion tokens over the request's sequences, max_tokens unset counting the
        whole context: the most work it can make."""
        limit, room = self.max_request_tokens, self.engine.max_model_len
        asked = req.n * sum(min(len(ids) + (req.max_new_tokens() or room), room) for ids in prompts)
        if asked > limit:
            raise APIError(400, f"this request may take {asked} tokens of work (prompt and completion tokens over "
                                f"its {len(prompts) * req.n} sequence(s)); this server's limit is {limit}: ask "
                                f"for fewer max_tokens, prompts or n", param="max_tokens", code="request_too_large")

    def check_context(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(ids) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens and the prompt has "
                                f"{len(ids)} (the context must also hold at least one generated token)",
                           param=param, code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you asked for "
                                f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to write)",
                           param="max_tokens", code="context_length_exceeded")

    # -- generation -------------------------------------------------------------------------

    async def generate(self, request: Request, req: SamplingRequest, prompts: list[list[int]],
                       fmt: CompletionFormat | ChatFormat,
                       structured: StructuredOutputsParams | None = None) -> Response:
        rid = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        # Choice index = prompt index × n + j, as the OpenAI API numbers them.
        seqs = [(ids, req.sampling_params(j, structured)) for ids in prompts for j in range(req.n)]
        try:
            stream = self.worker.submit(rid, seqs)
        except (ShuttingDown, Overloaded) as e:
            raise api_error(e, rid) from None
        try:
            await stream.admitted()
        except BaseException as e:  # refused, or this handler was cancelled: give back what was taken
            stream.close()
            if isinstance(e, Exception):
                raise api_error(e, rid) from None
            raise
        usage_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            # The background close covers a client gone before the first chunk: the generator, never
            # started, would not run its own `finally`.
            return StreamingResponse(self.stream_events(stream, req, fmt, usage_prompt),
                                     media_type="text/event-stream", background=BackgroundTask(stream.close))
        return await self.complete(request, stream, req, fmt, usage_prompt)

    async def complete(self, request: Request, stream: RequestStream, req: SamplingRequest,
                       fmt: CompletionFormat | ChatFormat, prompt_tokens: int) -> Response:
        n = len(stream.prompts)
        wants_logprobs = req.top_logprobs_wanted() is not None
        choices = [Delta(i, [], "", None, [] if wants_logprobs else None) for i in range(n)]

        async def collect() -> None:
            async for d in stream:
                choice = choices[d.index]
                choice.text += d.text
                choice.token_ids += d.token_ids
                choice.finish_reason = d.finish_reason
                if wants_logprobs:
                    choice.logprobs += d.logprobs

        # A client that hangs up must free its batch slots now, not when generation would end.
        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()
            stream.close()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        if work.exception() is not None:
            raise api_error(work.exception(), stream.request_id)
        usage = self.usage(prompt_tokens, [c.token_ids for c in choices], stream.seqs[::req.n])
        return JSONResponse(fmt.response(stream.request_id, self.model_name, choices,
                                         req.return_token_ids, usage=usage,
                                         speculative_stats=self.speculative_stats(stream.seqs)).model_dump())

    async def stream_events(self, stream: RequestStream, req: SamplingRequest,
                            fmt: CompletionFormat | ChatFormat, prompt_tokens: int) -> AsyncIterator[str]:
        rid, created, n = stream.request_id, int(time.time()), len(stream.prompts)
        ids: list[list[int]] = [[] for _ in range(n)]
        try:
            for body in fmt.opening(rid, created, self.model_name, n):
                yield sse(body)
            async for d in stream:
                ids[d.index] += d.token_ids
                if not (d.text or d.finish_reason or req.return_token_ids):
                    continue  # text held back (a possible stop string, an unfinished character)
                # Without a usage chunk, the last chunk carries the request's speculative statistics.
                last = stream.finished and not req.include_usage
                yield sse(fmt.chunk(rid, created, self.model_name, [d], req.return_token_ids,
                                    speculative_stats=self.speculative_stats(stream.seqs) if last else None))
            if req.include_usage:
                yield sse(fmt.chunk(rid, created, self.model_name, [], False,
                                    usage=self.usage(prompt_tokens, ids, stream.seqs[::req.n]),
                                    speculative_stats=self.speculative_stats(stream.seqs)))
        except (ShuttingDown, EngineFailure, RequestTimedOut) as e:
            # Headers are gone already: the error travels as an event, which OpenAI clients raise.
            yield sse(ErrorResponse(error=api_error(e, rid).info))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    @staticmethod
    def usage(prompt_tokens: int, ids: list[list[int]], firsts: list[Sequence]) -> UsageInfo:
        """Read once every sequence has finished. `firsts`: each prompt's first sequence (its n share one
        prefill, and its tokens count once)."""
        completion = sum(len(d) for d in ids)
        cached = sum(s.cached_tokens for s in firsts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def speculative_stats(self, seqs: list[Sequence]) -> SpeculativeStats:
        """Read only once every sequence has finished: the engine no longer touches them."""
        proposer = self.engine.proposer
        return SpeculativeStats(method=proposer.name if proposer is not None and self.engine.k else None,
                                num_speculative_tokens=self.engine.k, **sum_stats(seqs).as_dict())


def default_model_name(engine: Engine) -> str:
    return Path(engine.target.source).name.removesuffix(".gguf")


ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": why} for status, why in {
    400: "invalid request, or one asking for more than this server's limits",
    401: "missing or incorrect API key",
    403: "Host or Origin not allowed",
    404: "no such model or route",
    405: "method not allowed on this route (the Allow header lists those that are)",
    408: "the body took too long to arrive, or the request ran past its time limit",
    413: "request body too large",
    415: "the body is not application/json",
    500: "internal error: the message carries the request id the server log names",
    503: "the server is shutting down",
}.items()}


def add_request_bodies(schema: dict) -> dict:
    """Declare the POST bodies (the handlers parse them themselves, for strict validation and OpenAI errors)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema


def create_app(engine: Engine, served_model_names: list[str] | None = None, api_key: str | None = None,
               limits: ServerLimits | None = None, bind_host: str | None = None) -> FastAPI:
    """The FastAPI app behind its guard (the returned app's `.state.server` is the OpenAIServer). The engine
    thread starts and stops with the app's lifespan."""
    limits = limits or ServerLimits()
    server = OpenAIServer(engine, served_model_names or [default_model_name(engine)], limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        yield
        server.worker.stop()
        server.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Speculant", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    app.post("/v1/completions", responses=ERROR_RESPONSES, response_model=CompletionResponse)(server.completions)
    app.post("/v1/chat/completions", responses=ERROR_RESPONSES,
             response_model=ChatCompletionResponse)(server.chat_completions)
    app.get("/v1/models", responses=ERROR_RESPONSES, response_model=ModelList)(server.models)
    app.get("/health", responses=ERROR_RESPONSES)(server.health)
    app.get("/metrics", responses=ERROR_RESPONSES)(server.render_metrics)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_request_bodies(get_openapi(title=app.title, version=app.version,
                                                                routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keeps the exception's headers: a 405 names the allowed methods in Allow.
        return error_response(APIError(exc.status_code, str(exc.detail)), exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        request_id = f"err-{uuid.uuid4().hex}"
        log.error("unhandled error in %s (request id %s)", request.url.path, request_id,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return error_response(internal_error(request_id))

    app.add_middleware(RequestGuard, limits=limits, api_key=api_key,
                       hosts=allowed_host_names(bind_host, limits.allowed_hosts))
    return app


class Server(uvicorn.Server):
    """uvicorn with a drain before it closes connections: on SIGINT/SIGTERM, in-flight requests get
    `shutdown_timeout_s` to finish, then a clean error instead of a dropped connection."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float = 30.0):
        limits = config.app.state.server.limits
        if config.http == "auto":
            config.http = header_timeout_protocol(limits.header_timeout_s)
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets=None) -> None:
        worker = self.config.app.state.server.worker
        await worker.drain(self.shutdown_timeout_s, give_up=lambda: self.force_exit)
        await super().shutdown(sockets)
