"""The server's engine-facing core, which every endpoint family shares: limits and checks, tokenization off
the event loop, a request's run through the engine thread (worker.py), whole or streamed, its usage and
speculative statistics. The surfaces' handlers (openai/, responses/, messages/, tokens/) are thin over it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from speculant.audit.rules import describe_path
from speculant.config import StructuredOutputsParams
from speculant.engine import Engine
from speculant.sequence import Sequence, SpecStats
from speculant.server.bridge.auditor import Auditor, AuditSettings
from speculant.server.bridge.recorder import Recorder
from speculant.server.bridge.worker import (
    Delta,
    EngineFailure,
    EngineWorker,
    Overloaded,
    RequestStream,
    RequestTimedOut,
    ShuttingDown,
)
from speculant.server.chat.reasoning import ReasoningParser, opens_thought, reasoning_tags
from speculant.server.http.errors import APIError, ErrorResponse, api_error, sse, wait_for_disconnect
from speculant.server.http.guard import ServerLimits
from speculant.server.http.metrics import ServerMetrics
from speculant.server.openai.formats import ChatFormat, CompletionFormat
from speculant.server.openai.protocol import (
    PromptTokensDetails,
    SamplingRequest,
    SpeculativeStats,
    UsageInfo,
)
from speculant.server.responses.store import ResponseStore


def sum_stats(seqs: list[Sequence]) -> SpecStats:
    return sum((s.stats for s in seqs), SpecStats())


def default_model_name(engine: Engine) -> str:
    return Path(engine.target.source).name.removesuffix(".gguf")


class OpenAIServer:
    def __init__(self, engine: Engine, served_model_names: list[str], limits: ServerLimits | None = None,
                 audit: AuditSettings | None = None, reasoning_parser: str = "auto"):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        self.model_name = served_model_names[0]
        self.limits = limits or ServerLimits()
        self.max_request_tokens = self.limits.max_request_tokens or engine.max_batch_size * engine.max_model_len
        self.metrics = ServerMetrics(self.model_name, engine.k)
        self.audit = audit or AuditSettings()
        auditor = Auditor(engine, self.metrics, self.audit) if self.audit.rate > 0 else None
        recorder = Recorder(self.audit.record) if self.audit.record else None
        self.worker = EngineWorker(engine, self.metrics, self.limits.request_timeout_s,
                                   self.limits.max_waiting_requests, auditor, recorder, self.described())
        # Tokenization and template rendering: off the event loop, two at a time (the engine needs the rest).
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculant-tokenize")
        # POST /v1/responses' stored answers (responses/store.py)
        self.responses = ResponseStore(self.limits.responses_store_size, self.limits.responses_store_age_s)
        tok = self.tokenizer
        self.think_tags = None if tok is None else reasoning_tags(reasoning_parser, tok.vocab, tok.chat_template)

    def described(self) -> dict:
        """The engine as the record file names it."""
        return {"model": self.model_name, "source": self.engine.target.source, "proposer": self.engine.proposer_name,
                "k": self.engine.k, "speculative_config": self.audit.speculative_config,
                "path": describe_path(self.engine)}

    async def off_loop(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

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

    def need_chat_template(self, param: str) -> None:
        """A conversation needs the model's chat template: checked before a grammar's compilation, a request's
        costliest check."""
        self.need_tokenizer(param)
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template (a base model): send its prompt raw to "
                                "/v1/completions", param=param)

    def reasoning_for(self, prompt: list[int], structured: StructuredOutputsParams | None) -> ReasoningParser | None:
        """The parser that keeps a chat answer's thought apart, where the model thinks. A grammar (response_format,
        a required call) constrains the whole answer, so a constrained answer is all answer: no parser."""
        if self.think_tags is None or structured is not None:
            return None
        tail = self.tokenizer.decode(prompt[-16:], skip_special_tokens=False)
        return ReasoningParser(self.think_tags, opens_thought(self.think_tags, tail))

    async def tokenize(self, text: str) -> list[int]:
        return await self.off_loop(self.tokenizer.encode, text)

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
        wanted = req.max_new_tokens()
        asked = req.n * sum(min(len(ids) + (room if wanted is None else wanted), room) for ids in prompts)
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
        stream = await self.start(f"{fmt.id_prefix}-{uuid.uuid4().hex}", req, prompts, structured, request)
        usage_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            # The background close covers a client gone before the first chunk: the generator, never
            # started, would not run its own `finally`.
            return StreamingResponse(self.stream_events(stream, req, fmt, usage_prompt),
                                     media_type="text/event-stream", background=BackgroundTask(stream.close))
        return await self.complete(request, stream, req, fmt, usage_prompt)

    async def start(self, rid: str, req: SamplingRequest, prompts: list[list[int]],
                    structured: StructuredOutputsParams | None = None, request: Request | None = None) -> RequestStream:
        """The request handed to the engine thread, once the engine admitted it; `request`, the HTTP request,
        for the record file."""
        # Choice index = prompt index × n + j, as the OpenAI API numbers them.
        seqs = [(ids, req.sampling_params(j, structured)) for ids in prompts for j in range(req.n)]
        origin = await self.origin(request) if self.audit.record and request is not None else None
        try:
            stream = self.worker.submit(rid, seqs, origin)
        except (ShuttingDown, Overloaded) as e:
            raise api_error(e, rid) from None
        try:
            await stream.admitted()
        except BaseException as e:  # refused, or this handler was cancelled: give back what was taken
            stream.close()
            if isinstance(e, Exception):
                raise api_error(e, rid) from None
            raise
        return stream

    @staticmethod
    async def origin(request: Request) -> tuple[str, object]:
        """(endpoint, body as received): the body was read and parsed already (Starlette keeps it)."""
        body = await request.body()
        try:
            return request.url.path, json.loads(body)
        except ValueError:
            return request.url.path, body.decode("utf-8", "replace")

    async def complete(self, request: Request, stream: RequestStream, req: SamplingRequest,
                       fmt: CompletionFormat | ChatFormat, prompt_tokens: int) -> Response:
        choices = await self.collect(request, stream, req)
        if choices is None:
            return Response(status_code=499)  # nobody is listening any more
        usage = self.usage(prompt_tokens, [c.token_ids for c in choices], stream.seqs[::req.n])
        return JSONResponse(fmt.response(stream.request_id, self.model_name, choices,
                                         req.return_token_ids, usage=usage,
                                         speculative_stats=self.speculative_stats(stream.seqs)).model_dump())

    async def collect(self, request: Request, stream: RequestStream, req: SamplingRequest) -> list[Delta] | None:
        """Each choice's whole answer; None if the client hung up first."""
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
                if d.prompt_logprobs is not None:
                    choice.prompt_logprobs = d.prompt_logprobs

        # A client that hangs up must free its batch slots now, not when generation would end.
        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()
            stream.close()
        if not work.done() or work.cancelled():
            return None
        if work.exception() is not None:
            raise api_error(work.exception(), stream.request_id)
        return choices

    async def stream_events(self, stream: RequestStream, req: SamplingRequest,
                            fmt: CompletionFormat | ChatFormat, prompt_tokens: int) -> AsyncIterator[str]:
        rid, created, n = stream.request_id, int(time.time()), len(stream.prompts)
        ids: list[list[int]] = [[] for _ in range(n)]
        try:
            for body in fmt.opening(rid, created, self.model_name, n):
                yield sse(body)
            async for d in stream:
                ids[d.index] += d.token_ids
                if not (d.text or d.finish_reason or req.return_token_ids or d.prompt_logprobs is not None):
                    continue  # text held back (a possible stop string, an unfinished character)
                # Without a usage chunk, the last chunk carries the request's speculative statistics.
                last = stream.finished and not req.include_usage
                yield sse(fmt.chunk(rid, created, self.model_name, [d], req.return_token_ids,
                                    speculative_stats=self.speculative_stats(stream.seqs) if last else None))
            if req.include_usage:
                yield sse(fmt.chunk(rid, created, self.model_name, [], False, choice_ids=ids,
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
        return SpeculativeStats(method=self.engine.proposer_name,
                                num_speculative_tokens=self.engine.k, **sum_stats(seqs).as_dict())

