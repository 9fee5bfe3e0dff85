"""`speculant serve --replicas 2` on a local Ray cluster, for the slow replica tests: started on loopback, waited
for, stopped with SIGTERM (its drain), its log where SPECULANT_RAY_TEST_LOG says."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from speculant.server.scaleout.replicas import wait_for_replicas

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.perf_counter() + timeout_s
    while not ready():
        assert time.perf_counter() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def loopback_only() -> bool:
    return {name for _, name in socket.if_nameindex()} <= {"lo"}


def need_ray_on_loopback(test_file: str) -> None:
    """Skip, saying how to run it, where Ray is missing or the network is not loopback only."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed: pip install 'speculant[ray]'")
    if not loopback_only() and not os.environ.get("SPECULANT_RAY_ANY_NETWORK"):
        pytest.skip("Ray opens ports on every interface: run in a loopback-only namespace, "
                    f"unshare -n sh -c 'ip link set lo up && pytest -m slow {test_file}' "
                    "(or set SPECULANT_RAY_ANY_NETWORK=1)")


@contextlib.contextmanager
def two_replicas(model: Path, test_file: str, args: list[str], ready: Callable[[str], bool],
             timeout_s: float) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of `speculant serve MODEL --replicas 2 ARGS` once `ready(url)`; skipped where Ray is
    missing or the network is not loopback only (Ray opens some ports on every interface)."""
    need_ray_on_loopback(test_file)
    port = free_port()
    log = open(os.environ.get("SPECULANT_RAY_TEST_LOG", os.devnull), "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "speculant.cli", "--log-level", "INFO", "serve", str(model),
                             "--replicas", "2", "--port", str(port), "--api-key", API_KEY,
                             "--served-model-name", "smollm", *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    try:
        wait_until(lambda: proc.poll() is None and ready(url), timeout_s, "2 replicas reporting")
        # and the proxy's router routing to both (it learns of each a moment after Ray reports it up)
        assert len(wait_for_replicas(url, 2, 60)) == 2, "the proxy does not route to both replicas"
        print(f"2 replicas ready in {time.perf_counter() - started:.1f}s")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
