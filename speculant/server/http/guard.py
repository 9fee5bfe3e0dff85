"""What a request must pass before any handler sees it, and the server's limits.

`RequestGuard` (ASGI middleware) checks, in this order: the Host (and Origin, when sent) against an
allow-list, so a web page cannot drive a local server through DNS rebinding or a cross-site form; the API
key, on every path but /health; that a body is `application/json`; the body's size; the time it takes to
arrive. It reads the whole body itself and hands it on, so a handler never waits on a slow client.
`header_timeout_protocol` ends connections whose request headers do not arrive in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from speculant.errors import SpeculantError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")


@dataclass
class ServerLimits:
    """What one request may ask of the server; each is a `speculant serve` flag."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_sequences: int = 64  # prompts × n of one request
    # Prompt plus completion tokens summed over a request's sequences (max_tokens unset: up to the
    # context). None: the batch's whole context, max_batch_size × max_model_len.
    max_request_tokens: int | None = None
    request_timeout_s: float | None = None  # None: no limit
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    allowed_hosts: list[str] = field(default_factory=list)  # besides loopback names; "*": any
    public_metrics: bool = False  # /metrics without the API key, for a scraper
    # Requests beyond the batch's rows that may wait for one; more get a 429 with Retry-After. None: no bound.
    max_waiting_requests: int | None = 256
    # The Responses API's stored responses (responses/store.py): at most this many, none older; the oldest go first.
    responses_store_size: int = 1000
    responses_store_age_s: float = 3600.0


def host_name(value: str) -> str:
    """'Host' or an Origin's host part → the name without its port, lower case."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def allowed_host_names(bind_host: str | None, extra: Iterable[str]) -> set[str] | None:
    """The Host names served: loopback, the address bound (unless a wildcard), `extra`; None: any."""
    extra = list(extra)
    if "*" in extra:
        return None
    names = set(LOOPBACK_HOSTS) | {host_name(h) for h in extra}
    if bind_host is not None and bind_host not in WILDCARD_ADDRESSES:
        names.add(host_name(bind_host))
    return names


class Refused(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 close: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.close = close  # the body was not read: the connection cannot carry another request


# Anthropic's error types by status, as its SDKs map them to exceptions.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """The Messages API's routes, whose errors leave in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None,
               status: int | None = None, path: str = "") -> bytes:
    """OpenAI's error body, or Anthropic's on the Messages API's routes (`status` then picks its type)."""
    if anthropic_path(path) and status is not None:
        return json.dumps(anthropic_error(status, message)).encode()
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


class RequestGuard:
    def __init__(self, app, limits: ServerLimits, api_key: str | None, hosts: set[str] | None):
        self.app = app
        self.limits = limits
        self.expected_auth = None if api_key is None else f"Bearer {api_key}".encode()
        self.expected_key = None if api_key is None else api_key.encode()  # Anthropic's clients send x-api-key
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self.check(scope, receive)
        except Refused as e:
            await self.refuse(send, e, scope["path"])
            return
        if body is None:  # nothing to read, or the client left while sending
            await self.app(scope, receive, send)
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def check(self, scope, receive) -> bytes | None:
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        if self.hosts is not None:
            if host_name(headers.get("host", "")) not in self.hosts:
                raise Refused(403, "this server does not answer for that Host (see --allowed-hosts)",
                              "permission_error", "host_not_allowed")
            origin = headers.get("origin")
            if origin is not None and host_name(origin.partition("://")[2].partition("/")[0]) not in self.hosts:
                raise Refused(403, "cross-origin requests are not allowed (see --allowed-hosts)",
                              "permission_error", "origin_not_allowed")
        path = scope["path"]
        if self.expected_auth is not None and path != "/health" \
                and not (path == "/metrics" and self.limits.public_metrics):
            given = headers.get("authorization", "").encode("latin-1")
            key = headers.get("x-api-key", "").encode("latin-1")
            # Both compared, always: the time taken says nothing about which header was sent.
            by_bearer = secrets.compare_digest(given, self.expected_auth)
            by_key = secrets.compare_digest(key, self.expected_key)
            if not (by_bearer or by_key):
                raise Refused(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' or "
                                   "'x-api-key: <key>'", code="invalid_api_key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise Refused(415, "request bodies must be JSON, sent with 'Content-Type: application/json'",
                          code="unsupported_media_type", close=True)
        limit = self.limits.max_body_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise Refused(413, f"the request body is larger than this server's limit of {limit} bytes",
                          code="request_too_large", close=True)
        return await self.read_body(receive)

    async def read_body(self, receive) -> bytes | None:
        """The whole body, or None if the client left; Refused past the size or time limit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise Refused(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                              code="request_timeout", close=True) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise Refused(413, f"the request body is larger than this server's limit of "
                                   f"{self.limits.max_body_bytes} bytes", code="request_too_large", close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def refuse(send, e: Refused, path: str = "") -> None:
        body = error_body(e.message, e.type, None, e.code, e.status, path)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if e.close:
            headers.append((b"connection", b"close"))
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than `timeout_s`
    from its first byte (or from the connection, for the first request): a client that sends half a
    request holds no connection for long."""

    class HeaderTimeoutProtocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.arm()

        def arm(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(timeout_s, self.headers_too_slow)

        def disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # the bytes of a request's headers
                self.arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self.disarm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    positive = {"--max-body-bytes": args.max_body_bytes, "--max-request-sequences": args.max_request_sequences,
                "--max-request-tokens": args.max_request_tokens, "--request-timeout": args.request_timeout,
                "--header-timeout": args.header_timeout, "--body-timeout": args.body_timeout,
                "--max-waiting-requests": args.max_waiting_requests,
                "--responses-store-size": args.responses_store_size,
                "--responses-store-age": args.responses_store_age}
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise SpeculantError(f"{flag} must be > 0, got {value:g}")
    return ServerLimits(max_body_bytes=args.max_body_bytes, max_sequences=args.max_request_sequences,
                        max_request_tokens=args.max_request_tokens, request_timeout_s=args.request_timeout,
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        allowed_hosts=args.allowed_hosts, public_metrics=args.public_metrics,
                        max_waiting_requests=args.max_waiting_requests,
                        responses_store_size=args.responses_store_size,
                        responses_store_age_s=args.responses_store_age)
