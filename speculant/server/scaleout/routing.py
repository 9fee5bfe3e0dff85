"""Prefix-aware routing across replicas: the pure parts, importable without Ray (docs/scale-out.md).

A request's prompt, as the proxy sees it in the body (chat messages or a completion prompt), becomes a
chain of block hashes: the text cut into blocks of BLOCK_CHARS characters, each block's hash folding in
the one before, as vLLM hashes its cache blocks. A chain's i-th hash names the whole text up to the end of
block i, so two prompts share their first n blocks exactly when their chains share the first n hashes.

Each replica keeps a ledger of the chains of the requests it served, mirroring its prefix cache (one
entry per past sequence, least recently used first, an entry that a newer prompt extends replaced by it)
and reports the hashes it holds; the router sends a request to the replica holding the longest prefix of
its chain, unless that replica is busier than the least loaded one by more than a threshold.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PREFIX_HEADER = "x-speculant-prefix"  # set by the proxy's middleware, read by the router and the replica
BLOCK_CHARS = 64  # about 16 tokens: a short first turn still fills a few blocks
MAX_BLOCKS = 512  # the first 32K characters decide; the header stays under 9 KB
MAX_BODY_BYTES = 4 << 20  # a larger body is not read in the proxy: it is routed by load
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_IMBALANCE = 4


# -- a prompt's chain ----------------------------------------------------------------------------


def content_text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def routing_text(body: Mapping) -> str | None:
    """The text whose prefixes decide the route: the chat messages (role and content, in order), or a
    completion's single prompt; None when there is none (several prompts, token ids)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role', '')}\x1f{content_text(m.get('content'))}\x1e"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def prefix_chain(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The hashes of the text's whole blocks, each over its block and the hash before it (64-bit)."""
    chain, previous = [], b""
    for start in range(0, min(len(text), block_chars * max_blocks) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start:start + block_chars].encode(), digest_size=8).digest()
        chain.append(int.from_bytes(previous, "big"))
    return chain


def encode_chain(chain: Sequence[int]) -> str:
    return ",".join(f"{h:016x}" for h in chain)


def decode_chain(value: str | bytes | None) -> list[int]:
    """A header's chain; nothing (route by load) for a malformed one."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value:
        return []
    try:
        return [int(h, 16) for h in value.split(",")[:MAX_BLOCKS]]
    except ValueError:
        return []


def body_chain(body: bytes) -> list[int]:
    """The chain of a request body, or nothing when the body is not a JSON object with a prompt."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    text = routing_text(parsed) if isinstance(parsed, dict) else None
    return prefix_chain(text) if text else []


def header_chain(headers: Iterable[tuple[bytes, bytes]]) -> list[int]:
    name = PREFIX_HEADER.encode()
    return next((decode_chain(v) for k, v in headers if k.lower() == name), [])


# -- what a replica holds ------------------------------------------------------------------------


class PrefixLedger:
    """Chains of past requests, least recently used first; a chain that extends an entry replaces it, as
    the prefix cache keeps one entry per conversation."""

    def __init__(self) -> None:
        self.entries: OrderedDict[int, tuple[list[int], float]] = OrderedDict()  # last hash → (chain, time)

    def record(self, chain: Sequence[int], at: float = 0.0) -> None:
        if not chain:
            return
        chain = list(chain)
        for key, (held, _) in list(self.entries.items()):
            if len(held) >= len(chain) and held[len(chain) - 1] == chain[-1]:  # already held, as part of it
                self.entries[key] = (held, at)
                self.entries.move_to_end(key)
                return
            if len(held) < len(chain) and chain[len(held) - 1] == key:  # this one extends it
                del self.entries[key]
        self.entries[chain[-1]] = (chain, at)

    def keep_newest(self, n: int) -> None:
        while len(self.entries) > max(n, 0):
            self.entries.popitem(last=False)

    def expire(self, before: float) -> None:
        for key in [k for k, (_, at) in self.entries.items() if at < before]:
            del self.entries[key]

    def hashes(self, newest: int | None = None, limit: int = 16 * MAX_BLOCKS) -> set[int]:
        """Every hash of the `newest` entries (all by default), newest first, at most `limit` of them."""
        chains = [c for c, _ in reversed(self.entries.values())]
        held: set[int] = set()
        for chain in chains if newest is None else chains[:max(newest, 0)]:
            if len(held) + len(chain) > limit:
                break
            held.update(chain)
        return held


def matched_blocks(chain: Sequence[int], held: set[int]) -> int:
    """How many of the chain's first blocks are held (a chained hash names its whole prefix)."""
    for n in range(len(chain), 0, -1):
        if chain[n - 1] in held:
            return n
    return 0


# -- the choice -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    replica: str | None  # None: route by load (Ray's power of two choices)
    reason: str  # "prefix", "imbalanced", "no_match", "no_prefix"
    matched: int = 0  # blocks of the prompt the chosen (or best) replica holds


def choose_by_prefix(chain: Sequence[int], held: Mapping[str, set[int]], queue: Mapping[str, int | None],
                     imbalance: int = DEFAULT_IMBALANCE) -> Choice:
    """The replica holding the longest prefix of `chain` (the least loaded of those tied), unless its
    queue exceeds the least loaded replica's by more than `imbalance` requests: then load decides."""
    if not chain:
        return Choice(None, "no_prefix")
    match = {r: matched_blocks(chain, held.get(r, set())) for r in queue}
    best_n = max(match.values(), default=0)
    if best_n == 0:
        return Choice(None, "no_match")
    known = [q for q in queue.values() if q is not None]
    least = min(known, default=0)

    def load(r: str) -> int:
        return queue[r] if queue[r] is not None else least

    best = min((r for r, n in match.items() if n == best_n), key=lambda r: (load(r), r))
    if load(best) - least > imbalance:
        return Choice(None, "imbalanced", best_n)
    return Choice(best, "prefix", best_n)


# -- ASGI middlewares: the proxy's hint, the replica's ledger --------------------------------------


class AddPrefixHint:
    """In Ray's proxy, before the router: reads a completion's body (the router sees only the headers)
    and puts its chain in the PREFIX_HEADER; a client's own value of that header is dropped. A body
    that is too large, or slower than `wait_s`, goes on without a hint, routed by load."""

    def __init__(self, app, wait_s: float = 10.0):
        self.app, self.wait_s = app, wait_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = PREFIX_HEADER.encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != name]
        buffered: list[dict] = []
        if scope.get("method") == "POST" and scope.get("path") in ROUTED_PATHS:
            body = await read_body(receive, buffered, self.wait_s)
            chain = body_chain(body) if body is not None else []
            if chain:
                headers.append((name, encode_chain(chain).encode()))

        async def replay() -> dict:
            return buffered.pop(0) if buffered else await receive()

        await self.app({**scope, "headers": headers}, replay, send)


async def read_body(receive, into: list[dict], wait_s: float) -> bytes | None:
    """Receive a request body into `into`; None when it ends early, runs past MAX_BODY_BYTES or
    takes longer than `wait_s` (what was read stays in `into`, for the app)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline, size = loop.time() + wait_s, 0
    while size <= MAX_BODY_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
        except asyncio.TimeoutError:
            return None
        into.append(message)
        if message["type"] != "http.request":
            return None
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(m.get("body", b"") for m in into)
    return None


class RecordPrefix:
    """In a replica: a request that carries a chain and is answered in full (status 200) enters the
    ledger. `arrived(chain)` hears of each request with a chain as it arrives."""

    def __init__(self, app, ledger: PrefixLedger, arrived=None, clock=None):
        import time

        self.app, self.ledger, self.arrived = app, ledger, arrived
        self.clock = clock or time.monotonic

    async def __call__(self, scope, receive, send) -> None:
        chain = header_chain(scope.get("headers", [])) if scope["type"] == "http" else []
        if not chain:
            await self.app(scope, receive, send)
            return
        if self.arrived is not None:
            self.arrived(chain)
        status = 0

        async def watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if (message["type"] == "http.response.body" and not message.get("more_body", False)
                    and status == 200):
                self.ledger.record(chain, self.clock())

        await self.app(scope, receive, watch)
