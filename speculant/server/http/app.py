"""The OpenAI-compatible HTTP API over one engine: the FastAPI app, its routes and its error handlers.

POST /v1/completions, POST /v1/chat/completions (openai/routes.py), GET /v1/models, GET /health, GET /metrics
(info.py), POST /tokenize, POST /detokenize (tokens/routes.py), POST /v1/responses, GET and DELETE
/v1/responses/{id} (responses/routes.py), POST /v1/messages and /v1/messages/count_tokens (messages/routes.py:
Anthropic's API, its errors in Anthropic's shape). Requests first pass the guard (guard.py: host, key,
content type, body size and time). Handlers validate, tokenize (in a thread: the event loop keeps answering)
and hand the request to the engine thread (bridge/core.py, bridge/worker.py); they never touch the engine
themselves. Every error leaves as the OpenAI error body with a 4xx/5xx status; a 5xx says only which request
failed, the log says why.
"""

from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculant.engine import Engine
from speculant.server.bridge.auditor import AuditSettings
from speculant.server.bridge.core import OpenAIServer, default_model_name
from speculant.server.http import info
from speculant.server.http.errors import APIError, error_response, internal_error
from speculant.server.http.guard import RequestGuard, ServerLimits, allowed_host_names, header_timeout_protocol
from speculant.server.messages import routes as messages
from speculant.server.messages.protocol import CountTokensRequest, MessagesRequest
from speculant.server.openai import routes as completions
from speculant.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from speculant.server.responses import routes as responses
from speculant.server.responses.protocol import ResponsesRequest
from speculant.server.tokens import routes as tokens
from speculant.server.tokens.protocol import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("speculant.server")


BODIES = (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest),
          ("/v1/responses", ResponsesRequest), ("/v1/messages", MessagesRequest),
          ("/v1/messages/count_tokens", CountTokensRequest), ("/tokenize", TokenizeRequest),
          ("/detokenize", DetokenizeRequest))


def add_request_bodies(schema: dict) -> dict:
    """Declare the POST bodies (the handlers parse them themselves, for strict validation and OpenAI errors)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema


def create_app(engine: Engine, served_model_names: list[str] | None = None, api_key: str | None = None,
               limits: ServerLimits | None = None, bind_host: str | None = None,
               audit: AuditSettings | None = None, reasoning_parser: str = "auto") -> FastAPI:
    """The FastAPI app behind its guard (the returned app's `.state.server` is the OpenAIServer). The engine
    thread starts and stops with the app's lifespan. `audit`: the lossless audit and the record file
    (bridge/auditor.py; default off); `reasoning_parser`: chat/reasoning.py's REASONING_PARSERS."""
    limits = limits or ServerLimits()
    server = OpenAIServer(engine, served_model_names or [default_model_name(engine)], limits, audit, reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        yield
        server.worker.stop()
        server.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Speculant", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    for router in (completions.router, responses.router, messages.router, info.router, tokens.router):
        app.include_router(router)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_request_bodies(get_openapi(title=app.title, version=app.version,
                                                                routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, exc.headers, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keeps the exception's headers: a 405 names the allowed methods in Allow.
        return error_response(APIError(exc.status_code, str(exc.detail)), exc.headers, request.url.path)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        request_id = f"err-{uuid.uuid4().hex}"
        log.error("unhandled error in %s (request id %s)", request.url.path, request_id,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return error_response(internal_error(request_id), path=request.url.path)

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
