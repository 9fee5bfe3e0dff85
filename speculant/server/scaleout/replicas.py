"""`speculant serve --replicas N`: the pure parts, importable without Ray.

What is checked before anything starts (replica count, CPUs, Ray installed), how a session id picks its
replica, and how every replica's Prometheus text becomes one exposition with a `replica` label. The
Ray Serve side lives in ray_serve.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
import urllib.request
from collections.abc import Mapping, Sequence

from speculant.errors import SpeculantError

SESSION_HEADER = "x-session-id"  # Ray Serve's own session header: its proxy hands it to the router
REPLICA_HEADER = "x-speculant-replica"  # which replica answered, for logs and tests


def wait_for_replicas(url: str, replicas: int, timeout_s: float) -> set[str]:
    """GET `url`/health through the proxy until `replicas` distinct replicas have answered; the ids seen
    (fewer at the timeout). A proxy's router learns of each replica a moment after Ray reports it up: a
    burst of new conversations sent before would all land on the first replica, and stay there."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
    while len(seen) < replicas and time.monotonic() < deadline:
        try:
            with direct.open(url + "/health", timeout=2) as r:
                seen.add(r.headers.get(REPLICA_HEADER) or "")
            seen.discard("")
            time.sleep(0.05)
        except OSError:  # not routed yet (404), draining (503), or not listening
            time.sleep(0.2)
    return seen


def cpu_count() -> int:
    """The CPUs this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def replica_threads(replicas: int, threads: int | None, cpus: int | None) -> int:
    """The threads each replica runs with: --threads, else an equal share of the CPUs (one where the
    cluster, not this machine, holds them)."""
    if threads:
        return threads
    return max(1, cpus // replicas) if cpus else 1


def check_replicas(replicas: int, threads: int | None, cpus: int | None) -> int:
    """Refuse a replica count that cannot run, before any model loads; returns each replica's threads.
    `cpus` None: the replicas run on an existing Ray cluster, which places them itself."""
    if replicas < 1:
        raise SpeculantError(f"--replicas must be at least 1, got {replicas}")
    per_replica = replica_threads(replicas, threads, cpus)
    if replicas == 1:
        return per_replica
    if cpus is not None and replicas * per_replica > cpus:
        raise SpeculantError(f"--replicas {replicas} with {per_replica} thread(s) each needs {replicas * per_replica} "
                             f"CPUs; this machine has {cpus}: replicas sharing cores only wait on each other "
                             f"(docs/scale-out.md)")
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise SpeculantError("--replicas above 1 runs on Ray Serve, which is not installed: "
                             "pip install 'speculant[ray]'")
    return per_replica


def session_replica(session_id: str, replicas: Sequence[str]) -> str:
    """The replica a session sticks to: rendezvous hashing, so when a replica leaves or joins only the
    sessions it held (or takes) move, and every router process picks the same one without talking."""
    if not replicas:
        raise ValueError("no replicas to choose from")

    def weight(replica: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\0{replica}".encode(), digest_size=8).digest()

    return max(replicas, key=weight)


# -- one /metrics for every replica -----------------------------------------------------------


def label_sample(line: str, replica: str) -> str:
    """`name{a="b"} 1` → `name{replica="r",a="b"} 1`: the metric name cannot hold '{' or a space, so the
    first of them ends it."""
    label = f'replica="{escape_label(replica)}"'
    cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
    if line[cut:cut + 1] == "{":
        rest = line[cut + 1:]
        return f"{line[:cut]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{line[:cut]}{{{label}}}{line[cut:]}"


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def metric_families(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """Prometheus text → family name → (its # HELP/# TYPE lines, its sample lines), in order. A family
    starts at its `# HELP` line (prometheus-client writes one for every family)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = families.setdefault(parts[2], ([], []))
                if line not in current[0]:
                    current[0].append(line)
            continue
        if current is None:  # a sample before any header: its own family
            current = families.setdefault(line.split("{", 1)[0].split(" ", 1)[0], ([], []))
        current[1].append(line)
    return families


def merge_metrics(reports: Mapping[str, str]) -> str:
    """Every replica's exposition (replica id → text) as one, each sample labelled with its replica and
    each family's samples together under one header, as the format requires."""
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in sorted(reports.items()):
        for name, (header, samples) in metric_families(text).items():
            into = merged.setdefault(name, (list(header), []))
            into[1].extend(label_sample(s, replica) for s in samples)
    lines = [line for header, samples in merged.values() for line in header + samples]
    return "\n".join(lines) + "\n" if lines else ""


# -- in Ray's proxy: a replica lost mid-request --------------------------------------------------

REPLICA_LOST = ("the replica serving this request stopped before it finished (it is being restarted); "
                "the request can be sent again")


def replica_lost_body() -> bytes:
    return json.dumps({"error": {"message": REPLICA_LOST, "type": "service_unavailable", "param": None,
                                 "code": "replica_lost"}}).encode()


class EndLostResponses:
    """ASGI middleware for Ray's proxy. When a replica dies, the proxy sends nothing more: a response not
    begun would leave as a bare 500, a stream as a cut connection. This ends the first with the OpenAI
    error body (503) and the second with an error event and [DONE], as a stream ends on a server error."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = stream = False

        async def watch(message) -> None:
            nonlocal started, finished, stream
            if message["type"] == "http.response.start":
                started = True
                stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        await self.app(scope, receive, watch)
        if finished:
            return
        if not started:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": replica_lost_body()})
        elif stream:
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + replica_lost_body() + b"\n\ndata: [DONE]\n\n"})


def proxy_middlewares() -> list:
    """Ray's proxy calls this (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH) for the middlewares it runs: clean
    errors for lost replicas, and the prompt's prefix chain in a header for the router (routing.py)."""
    from starlette.middleware import Middleware

    from speculant.server.scaleout.routing import AddPrefixHint

    return [Middleware(EndLostResponses), Middleware(AddPrefixHint)]
