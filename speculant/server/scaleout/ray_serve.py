"""`speculant serve --replicas N` on Ray Serve: N whole engines behind Ray's HTTP proxy.

Each replica is today's server (create_app over one engine) run by Ray: `num_cpus` its threads, at most
`max_ongoing_requests` = its batch size, so Ray queues what the batch cannot take and each engine still
does its own batching. Routing (`--routing`) is prefix-aware by default (PrefixAffinityRouter: the replica
holding the longest prefix of the prompt, unless it is much busier than the least loaded one), or Ray's
power of two choices on queue length (`load`); either way a request carrying the `x-session-id` header
that prefixes do not place goes to its session's replica first (SessionAffinityRouter).

A second app at /metrics (MetricsHub, one replica, no CPU) serves every replica's series at once: each
replica reports its metrics there twice a second, and the reply carries the drain order on shutdown,
since Ray's proxy replaces uvicorn and today's SIGTERM drain never runs inside a replica.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import pickle
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter
from ray import serve
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter  # Ray's default
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from speculant.errors import SpeculantError
from speculant.server.http.guard import WILDCARD_ADDRESSES, RequestGuard, allowed_host_names, error_body
from speculant.server.scaleout.replicas import REPLICA_HEADER, merge_metrics, session_replica, wait_for_replicas
from speculant.server.scaleout.routing import (
    DEFAULT_IMBALANCE,
    PrefixLedger,
    RecordPrefix,
    choose_by_prefix,
    header_chain,
    matched_blocks,
)

log = logging.getLogger("speculant.server")
# The router runs in Ray's proxy: what it says goes to the proxy's own log file, beside its access lines.
route_log = logging.getLogger("ray.serve")

ENGINE_APP = "speculant"
HUB_APP = "speculant-metrics"
REPORT_PERIOD_S = 0.5
STALE_AFTER_S = 10.0  # a replica silent this long is gone: its series leave /metrics
HEALTH_PERIOD_S = 2.0
ROUTING_STATS_PERIOD_S = 1.0  # how often each replica tells the routers what its prefix cache holds
# What a router sent where counts as held while it runs and this long after: it bridges the wait for the
# replica's next report.
ROUTED_HOLD_S = 30.0
# Tries on a prefix's replica alone before the others are offered too: a busy replica may miss Ray's
# queue-length probe (0.1 s, doubling at each try), which would otherwise send the turn elsewhere at once.
HOME_TRIES = 4
ROUTABLE_WAIT_S = 60.0  # for the proxy to route to every replica before `serve` says it is serving


def session_ranks(candidate_replicas: list[RunningReplica],
                  pending_request: PendingRequest | None) -> list[list[RunningReplica]] | None:
    """A request with a session id: its session's replica first, then the others; None without one."""
    session = pending_request.metadata.session_id if pending_request is not None else ""
    if not session or len(candidate_replicas) < 2:
        return None
    by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
    home = by_id[session_replica(session, sorted(by_id))]
    return [[home], [r for r in candidate_replicas if r is not home]]


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Power of two choices, except that a request with a session id tries its session's replica first
    (history and lookup drafts are warm there), then the least loaded of the others."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranks = session_ranks(candidate_replicas, pending_request)
        return ranks or await super().choose_replicas(candidate_replicas, pending_request)


def request_chain(pending_request: PendingRequest | None) -> list[int]:
    """The prompt's chain that the proxy's AddPrefixHint put in the request's headers (the router sees
    the ASGI scope, not the body)."""
    args = pending_request.args if pending_request is not None else ()
    arg = args[0] if args else None
    if isinstance(arg, bytes):  # Ray's proxy pickles its StreamingHTTPRequest for the replica, in this process
        try:
            arg = pickle.loads(arg)
        except Exception:  # not the proxy's request: nothing to route by
            return []
    scope = getattr(arg, "asgi_scope", None)
    return header_chain(scope.get("headers", [])) if isinstance(scope, dict) else []


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """The replica holding the longest prefix of the prompt, as it reports through record_routing_stats
    and as this router sent it requests since; load decides (the session's replica, else the least
    loaded) where no replica holds a block of it, or where the best one's queue is longer than the least
    loaded one's by more than `imbalance` requests.

    Not FIFOMixin, as Ray's own PrefixCacheAffinityRouter: with it, the replica chosen for one request goes
    to whichever request has waited longest, and a conversation's turn lands on another's replica."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, hold_s: float = ROUTED_HOLD_S) -> None:
        self.imbalance, self.hold_s = imbalance, hold_s
        self.routed: dict[str, PrefixLedger] = {}
        self.reported: dict[str, tuple[int, set[int]]] = {}  # replica → (id of its stats list, as a set)
        # This router's requests not yet completed, by replica: counted from the moment of the choice, so a
        # burst of requests routed at once spreads (Ray's queue lengths arrive after the requests do).
        self.outstanding: dict[str, tuple[str, float | None]] = {}  # request id → (replica, chosen at; None: sent)
        self.load: collections.Counter[str] = collections.Counter()
        self.chains: dict[str, list[int]] = {}
        self.tries: collections.Counter[str] = collections.Counter()  # request id → choices made for it
        self.chosen: dict[str, tuple[str, int]] = {}  # request id → (the prefix's replica, blocks it holds)
        self.clock = time.monotonic

    def held(self, replica: RunningReplica) -> set[int]:
        rid = replica.replica_id.unique_id
        hashes = (replica.routing_stats or {}).get("prefix_hashes") or []
        if self.reported.get(rid, (None,))[0] != id(hashes):
            self.reported[rid] = (id(hashes), set(hashes))
        routed = self.routed.get(rid)
        if routed is None:
            return self.reported[rid][1]
        routed.expire(self.clock() - self.hold_s)
        return self.reported[rid][1] | routed.hashes()

    async def queue_lengths(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica: Ray's cache, else a probe (as Ray's PrefixCacheAffinityRouter),
        or this router's own count where that is higher."""
        queue = {r.replica_id.unique_id: self.replica_queue_len_cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if queue[r.replica_id.unique_id] is None]
        for r, n in await self._probe_queue_lens(missing, 0) if missing else []:
            queue[r.replica_id.unique_id] = n
        return {rid: max(n or 0, self.load[rid]) for rid, n in queue.items()}

    def assign(self, request_id: str, replica: str, sent: bool = False) -> None:
        self.forget(request_id)
        self.outstanding[request_id] = (replica, None if sent else self.clock())
        self.load[replica] += 1

    def forget(self, request_id: str, done: bool = False) -> None:
        if done:
            self.chains.pop(request_id, None)
            self.tries.pop(request_id, None)
            self.chosen.pop(request_id, None)
        replica, _ = self.outstanding.pop(request_id, (None, None))
        if replica is not None:
            self.load[replica] -= 1

    def forget_unsent(self, before: float) -> None:
        """Choices never sent (the client left while Ray waited for a free slot) stop counting; a request
        still waiting is chosen again, and counted again, at each of Ray's tries."""
        for request_id in [q for q, (_, at) in self.outstanding.items() if at is not None and at < before]:
            self.forget(request_id, done=True)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or len(candidate_replicas) < 2:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        request_id = pending_request.metadata.internal_request_id
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.forget(request_id)  # a retry: its earlier choice no longer counts as load
        self.chosen.pop(request_id, None)
        self.forget_unsent(self.clock() - self.hold_s)
        queue = await self.queue_lengths(candidate_replicas)  # the last await: the rest decides at once
        chain = self.chain(pending_request)
        choice = choose_by_prefix(chain, {rid: self.held(r) for rid, r in by_id.items()}, queue, self.imbalance)
        if choice.replica is not None:
            home = by_id[choice.replica]
            self.chosen[request_id] = (choice.replica, choice.matched)
        else:
            ranks = session_ranks(candidate_replicas, pending_request)
            home = ranks[0][0] if ranks else min(candidate_replicas,
                                                 key=lambda r: (queue[r.replica_id.unique_id], random.random()))
        self.assign(request_id, home.replica_id.unique_id)
        self.tries[request_id] += 1
        others = [r for r in candidate_replicas if r is not home]
        # The prefix's replica alone while it has room (its probe may just be slow); the others too once it is
        # full or has not answered. Ray backs off between rounds, so a full fleet does not spin the proxy.
        alone = (choice.replica is not None and self.tries[request_id] <= HOME_TRIES
                 and queue[choice.replica] < home.max_ongoing_requests)
        pending_request.routing_context.should_backoff = True
        route_log.debug("route %s: %s to %s, %d of %d blocks, queues %s, try %d", request_id, choice.reason,
                        home.replica_id.unique_id, choice.matched, len(chain), queue, self.tries[request_id])
        return [[home]] if alone else [[home], others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        held_on, matched = self.chosen.pop(request_id, (replica_id.unique_id, 0))
        if held_on != replica_id.unique_id:  # a lost prefix hit: the one thing an operator needs to see here
            route_log.info("route: request %s went to %s, not to %s which holds %d blocks of its prompt "
                           "(full, or it did not answer Ray's probe in %d tries)", request_id,
                           replica_id.unique_id, held_on, matched, self.tries[request_id])
        self.assign(request_id, replica_id.unique_id, sent=True)
        self.hold(replica_id.unique_id, self.chain(pending_request))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        # Held from the answer on, not from the choice: a turn may run longer than hold_s, and the next one
        # comes at once, before the replica's next report.
        if replica_id is not None:
            self.hold(replica_id.unique_id, self.chains.get(internal_request_id, []))
        self.forget(internal_request_id, done=True)

    def hold(self, replica: str, chain: list[int]) -> None:
        if chain:
            ledger = self.routed.setdefault(replica, PrefixLedger())
            ledger.record(chain, self.clock())
            ledger.keep_newest(1024)

    def chain(self, pending_request: PendingRequest) -> list[int]:
        """request_chain, read once per request (Ray may choose several times for one)."""
        request_id = pending_request.metadata.internal_request_id
        if request_id not in self.chains:
            self.chains[request_id] = request_chain(pending_request)
        return self.chains[request_id]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for gone in set(self.routed) - live:  # a replaced replica starts with an empty cache
            del self.routed[gone]
        for gone in set(self.reported) - live:
            del self.reported[gone]


class NameReplica:
    """ASGI middleware: every response says which replica wrote it."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


# -- the engine replica -----------------------------------------------------------------------


@serve.ingress()
class EngineReplica:
    """One whole engine and today's OpenAI server over it. (No attribute may be named `app`: Ray's
    wrapper owns that name.)"""

    def __init__(self, args: argparse.Namespace, threads: int):
        from speculant.arguments import engine_from_args
        from speculant.server.bridge.auditor import audit_settings_from_args
        from speculant.server.http.app import create_app
        from speculant.server.http.guard import limits_from_args

        torch.set_num_threads(threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        engine = engine_from_args(args)
        names = args.served_model_name or ([args.model] if args.model else None)
        self.openai_app = create_app(engine, names, args.api_key, limits_from_args(args), bind_host=args.host,
                                     audit=audit_settings_from_args(args), reasoning_parser=args.reasoning_parser)
        self.openai_app.add_middleware(NameReplica, replica=self.replica_id)
        self.server = self.openai_app.state.server
        self.ledger = PrefixLedger()
        self.arrivals = Counter("speculant:routed_prefix_requests", "Requests that arrived with a prompt prefix "
                                "chain, by whether this replica's prefix cache held its first block.",
                                ["model_name", "held"], registry=self.server.metrics.registry)
        self.openai_app.add_middleware(RecordPrefix, ledger=self.ledger, arrived=self.count_arrival)
        self.draining = False
        # Constructed on the replica's event loop, where its requests run too.
        self.reporter = asyncio.get_running_loop().create_task(self.report_forever())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.openai_app

    def held_chains(self) -> set[int]:
        """The hashes of the prompts this replica's prefix cache holds: the ledger's newest entries, as many
        as the cache has (both keep one entry per past sequence, least recently used first)."""
        cache = self.server.engine.prefix_cache
        if cache is None:
            return set()
        self.ledger.keep_newest(max(len(cache.entries), 64))  # bounded memory; the cache decides what counts
        return self.ledger.hashes(newest=len(cache.entries))

    def count_arrival(self, chain: list[int]) -> None:
        held = matched_blocks(chain, self.held_chains()) > 0
        self.arrivals.labels(self.server.metrics.model_name, "yes" if held else "no").inc()

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray calls this every ROUTING_STATS_PERIOD_S and hands the result to every router."""
        return {"prefix_hashes": sorted(self.held_chains())}

    def check_health(self) -> None:
        """Ray restarts a replica whose check fails: one whose engine thread died would never answer."""
        if not self.server.worker.alive:
            raise RuntimeError("the engine thread has died")

    async def report_forever(self) -> None:
        hub = serve.get_app_handle(HUB_APP)
        while True:
            try:
                worker = self.server.worker
                drain_s = await hub.report.remote(self.replica_id, self.server.metrics.render().decode(),
                                                  self.draining, len(worker.in_flight))
            except Exception as e:  # the hub restarting, or gone at shutdown: try again next period
                log.debug("metrics report failed: %s", e)
                drain_s = None
            if drain_s is not None and not self.draining:
                self.draining = True
                asyncio.get_running_loop().create_task(self.server.worker.drain(drain_s))
            await asyncio.sleep(REPORT_PERIOD_S)

    def __del__(self) -> None:
        reporter = getattr(self, "reporter", None)  # absent when the constructor failed (a model that won't load)
        if reporter is not None:
            reporter.cancel()


# -- the metrics hub --------------------------------------------------------------------------


@dataclass
class Report:
    at: float
    metrics: str
    draining: bool
    in_flight: int


@serve.ingress()
class MetricsHub:
    """Every replica's latest metrics, served as one exposition at /metrics; the shutdown's drain order."""

    def __init__(self, args: argparse.Namespace):
        from speculant.server.http.guard import limits_from_args

        self.args, self.limits = args, limits_from_args(args)
        self.reports: dict[str, Report] = {}
        self.drain_s: float | None = None

    def report(self, replica: str, metrics: str, draining: bool, in_flight: int) -> float | None:
        """A replica's latest numbers; answers the drain timeout once shutdown has begun."""
        self.reports[replica] = Report(time.monotonic(), metrics, draining, in_flight)
        return self.drain_s

    def live(self) -> dict[str, Report]:
        now = time.monotonic()
        self.reports = {r: rep for r, rep in self.reports.items() if now - rep.at < STALE_AFTER_S}
        return self.reports

    def begin_drain(self, timeout_s: float) -> None:
        self.drain_s = timeout_s

    def drained(self) -> bool:
        """Every replica still reporting has begun its drain and has nothing left in flight."""
        return all(r.draining and r.in_flight == 0 for r in self.live().values())

    def render(self) -> str:
        return merge_metrics({r: rep.metrics for r, rep in self.live().items()})

    def __serve_build_asgi_app__(self):
        return RequestGuard(MetricsEndpoint(self.render), limits=self.limits, api_key=self.args.api_key,
                            hosts=allowed_host_names(self.args.host, self.limits.allowed_hosts))


class MetricsEndpoint:
    """GET /metrics, the only route of its app: plain ASGI, so no router redirects the prefix Ray strips."""

    def __init__(self, render: Callable[[], str]):
        self.render = render

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] not in ("GET", "HEAD"):
            response = Response(error_body("method not allowed", "invalid_request_error"), status_code=405,
                                media_type="application/json", headers={"Allow": "GET, HEAD"})
        else:
            response = Response(self.render(), media_type=CONTENT_TYPE_LATEST)
        await response(scope, receive, send)


# -- the driver -------------------------------------------------------------------------------


def start_ray(replicas: int, threads: int) -> None:
    import ray

    # Read by Ray's proxy when it starts: it inherits this process's environment on a cluster started here.
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH",
                          "speculant.server.scaleout.replicas:proxy_middlewares")

    if os.environ.get("RAY_ADDRESS"):  # an existing cluster: it says what it has
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
        return
    # A private cluster of exactly the CPUs the replicas take; Ray's own actors take none.
    ray.init(num_cpus=replicas * threads, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING, configure_logging=True)


def router_config(routing: str, imbalance: int) -> RequestRouterConfig:
    if routing == "load":
        return RequestRouterConfig(request_router_class=SessionAffinityRouter)
    return RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                               request_router_kwargs={"imbalance": imbalance},
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                               request_routing_stats_timeout_s=10 * ROUTING_STATS_PERIOD_S)


def engine_deployment(args: argparse.Namespace, replicas: int, threads: int):
    return serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": threads},
        # Ray holds back what the batch cannot take: a request waits at the proxy for the first free slot
        # on any replica, not in one engine's queue.
        max_ongoing_requests=args.max_batch_size,
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=30,
        # Ray's own drain, the backstop behind ours: it must outlast the drain's timeout.
        graceful_shutdown_timeout_s=args.shutdown_timeout + 10, graceful_shutdown_wait_loop_s=0.2,
        request_router_config=router_config(args.routing, args.routing_imbalance),
    ).bind(args, threads)


def hub_deployment(args: argparse.Namespace):
    return serve.deployment(MetricsHub, name="MetricsHub", num_replicas=1,
                            ray_actor_options={"num_cpus": 0}).bind(args)


def stop_on_signal() -> threading.Event:
    """Set on SIGINT/SIGTERM, also while the replicas start: then they drain as soon as they are up."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def drain(timeout_s: float) -> None:
    """As one server's drain: refuse new requests, give in-flight ones `timeout_s`, end the rest with a
    clean error; only then does Ray stop the replicas and its proxy."""
    hub = serve.get_app_handle(HUB_APP)
    hub.begin_drain.remote(timeout_s).result()
    deadline = time.monotonic() + timeout_s + 5
    time.sleep(2 * REPORT_PERIOD_S)  # every replica hears of it at its next report
    while time.monotonic() < deadline and not hub.drained.remote().result():
        time.sleep(0.1)


def replica_error(app: str) -> str | None:
    """What a failed deployment's replicas raised, from Ray Serve's status: the SpeculantError's message
    where there is one, else the traceback's last line."""
    try:
        status = serve.status().applications[app]
    except Exception:  # no status to read: the caller says what it has
        return None
    text = "\n".join([status.message or ""] + [d.message for d in status.deployments.values() if d.message])
    ours = re.findall(r"SpeculantError: (.+)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return ours[-1] if ours else (lines[-1] if lines else None)


def serve_replicas(args: argparse.Namespace, replicas: int, threads: int) -> None:
    """Start Ray, deploy the metrics hub and N engine replicas, serve until SIGINT/SIGTERM, drain."""
    import ray

    start_ray(replicas, threads)
    stop = stop_on_signal()
    try:
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise SpeculantError(f"Ray Serve's HTTP proxy did not start on {args.host}:{args.port} "
                                 f"({type(e).__name__}); Ray gives it 5 s per readiness check, which a machine "
                                 "busy with other work can miss") from None
        serve.run(hub_deployment(args), name=HUB_APP, route_prefix="/metrics")
        try:
            serve.run(engine_deployment(args, replicas, threads), name=ENGINE_APP, route_prefix="/")
        except RuntimeError as e:
            raise SpeculantError(f"the replicas did not start: {replica_error(ENGINE_APP) or e}") from None
        host = "127.0.0.1" if args.host in WILDCARD_ADDRESSES else args.host
        seen = wait_for_replicas(f"http://{f'[{host}]' if ':' in host else host}:{args.port}", replicas,
                                 ROUTABLE_WAIT_S)
        if len(seen) < replicas:
            log.warning("the proxy routes to %d of %d replicas after %.0fs; the rest may follow", len(seen),
                        replicas, ROUTABLE_WAIT_S)
        log.info("serving on http://%s:%d: %d replicas on Ray Serve, %d thread(s) each, %s routing", args.host,
                 args.port, replicas, threads, args.routing)
        stop.wait()
        log.info("shutting down: draining %d replicas for up to %.0fs", replicas, args.shutdown_timeout)
        drain(args.shutdown_timeout)
        serve.delete(ENGINE_APP)
        serve.shutdown()
    finally:
        ray.shutdown()
