"""What every endpoint shares: the error body (OpenAI's; Anthropic's on the Messages API's routes), the HTTP
face of the engine's errors, strict body parsing, server-sent events."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from speculant.errors import SpeculantError
from speculant.server.bridge.worker import EngineFailure, Overloaded, RequestTimedOut, ShuttingDown
from speculant.server.http.guard import anthropic_error, anthropic_path

if TYPE_CHECKING:
    from speculant.server.openai.protocol import SamplingRequest

log = logging.getLogger("speculant.server")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

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


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def error_response(err: APIError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error as the surface at `path` writes it: Anthropic's shape on the Messages API, else OpenAI's."""
    body = anthropic_error(err.status, err.info.message) if anthropic_path(path) \
        else ErrorResponse(error=err.info).model_dump()
    return JSONResponse(body, status_code=err.status, headers=headers)


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


async def parse_json(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # A model's own check: its message as written, without pydantic's "Value error, " in front.
        msg = first["msg"].removeprefix("Value error, ") if first["type"] == "value_error" else first["msg"]
        if not loc:  # the body itself: not JSON, or not an object
            raise APIError(400, f"invalid request body: {msg}") from None
        raise APIError(400, f"{'.'.join(loc)}: {msg}", param=loc[0]) from None


async def parse_body(request: Request, model: type[SamplingRequest]) -> SamplingRequest:
    req = await parse_json(request, model)
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

