"""`speculant serve --replicas N` on Ray Serve: N whole engines behind Ray's HTTP proxy.

Each replica is today's server (create_app over one engine) run by Ray: `num_cpus` its threads, at most
`max_ongoing_requests` = its batch size, so Ray queues what the batch cannot take and each engine still
does its own batching. Routing is Ray's power of two choices on queue length, except that a request
carrying the `x-session-id` header goes to its session's replica first (SessionAffinityRouter).

A second app at /metrics (MetricsHub, one replica, no CPU) serves every replica's series at once: each
replica reports its metrics there twice a second, and the reply carries the drain order on shutdown,
since Ray's proxy replaces uvicorn and today's SIGTERM drain never runs inside a replica.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter  # Ray's default
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RunningReplica

from speculant.server.guard import RequestGuard, allowed_host_names, error_body
from speculant.server.replicas import REPLICA_HEADER, merge_metrics, session_replica

log = logging.getLogger("speculant.server")

ENGINE_APP = "speculant"
HUB_APP = "speculant-metrics"
REPORT_PERIOD_S = 0.5
STALE_AFTER_S = 10.0  # a replica silent this long is gone: its series leave /metrics
HEALTH_PERIOD_S = 2.0


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Power of two choices, except that a request with a session id tries its session's replica first
    (history and lookup drafts are warm there), then the least loaded of the others."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if not session or len(candidate_replicas) < 2:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        home = by_id[session_replica(session, sorted(by_id))]
        return [[home], [r for r in candidate_replicas if r is not home]]


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
        from speculant.server.app import create_app
        from speculant.server.auditor import audit_settings_from_args
        from speculant.server.guard import limits_from_args

        torch.set_num_threads(threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        engine = engine_from_args(args)
        names = args.served_model_name or ([args.model] if args.model else None)
        self.openai_app = create_app(engine, names, args.api_key, limits_from_args(args), bind_host=args.host,
                                     audit=audit_settings_from_args(args), reasoning_parser=args.reasoning_parser)
        self.openai_app.add_middleware(NameReplica, replica=self.replica_id)
        self.server = self.openai_app.state.server
        self.draining = False
        # Constructed on the replica's event loop, where its requests run too.
        self.reporter = asyncio.get_running_loop().create_task(self.report_forever())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.openai_app

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
        self.reporter.cancel()


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
        from speculant.server.guard import limits_from_args

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
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "speculant.server.replicas:proxy_middlewares")

    if os.environ.get("RAY_ADDRESS"):  # an existing cluster: it says what it has
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
        return
    # A private cluster of exactly the CPUs the replicas take; Ray's own actors take none.
    ray.init(num_cpus=replicas * threads, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING, configure_logging=True)


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
        request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
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


def serve_replicas(args: argparse.Namespace, replicas: int, threads: int) -> None:
    """Start Ray, deploy the metrics hub and N engine replicas, serve until SIGINT/SIGTERM, drain."""
    import ray

    start_ray(replicas, threads)
    stop = stop_on_signal()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(hub_deployment(args), name=HUB_APP, route_prefix="/metrics")
        serve.run(engine_deployment(args, replicas, threads), name=ENGINE_APP, route_prefix="/")
        log.info("serving on http://%s:%d: %d replicas on Ray Serve, %d thread(s) each", args.host, args.port,
                 replicas, threads)
        stop.wait()
        log.info("shutting down: draining %d replicas for up to %.0fs", replicas, args.shutdown_timeout)
        drain(args.shutdown_timeout)
        serve.delete(ENGINE_APP)
        serve.shutdown()
    finally:
        ray.shutdown()
