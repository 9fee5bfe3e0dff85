"""Do replicas pay on this machine? The same load on one engine, on Ray Serve replicas, and on nginx
`least_conn` over plain servers; aggregate tokens/s, time to first token, resident memory.

    unshare -n sh -c 'ip link set lo up && python tools/scaleout_probe.py'            # 2 replicas
    unshare -n sh -c 'ip link set lo up && python tools/scaleout_probe.py --replicas 4 --clients 32'

Ray opens ports on every interface: run it in a loopback-only namespace. nginx is skipped when absent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx
import psutil

from speculant.bench.loadtest import PROMPTS

NGINX_CONF = """worker_processes 1; daemon off; pid {root}/nginx.pid; error_log {root}/error.log;
events {{}}
http {{
  access_log off;
  upstream speculant {{ least_conn; {servers} keepalive 32; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://speculant; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header Host $host; proxy_buffering off; proxy_read_timeout 600s;
    }}
  }}
}}
"""


def serve(port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "--port", str(port),
                             "--served-model-name", "smollm", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    body = {"model": "smollm", "prompt": "hi", "max_tokens": 1}
    while time.time() < deadline:
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def rss_gib(procs: list[subprocess.Popen]) -> float:
    """Resident memory of these processes and all their descendants (Ray's workers included)."""
    seen: set[int] = set()
    total = 0
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            for q in [root, *root.children(recursive=True)]:
                if q.pid not in seen:
                    seen.add(q.pid)
                    total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**30


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, time to first token) of one greedy stream."""
    body = {"model": "smollm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return tokens, first or 0.0


async def load(url: str, clients: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(*(one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)
                                      for i in range(clients)))
        wall = time.perf_counter() - start
    tokens = sum(t for t, _ in runs)
    return {"clients": clients, "tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
            "mean_ttft_s": round(sum(f for _, f in runs) / clients, 3)}


def measure(name: str, url: str, procs: list[subprocess.Popen], args) -> None:
    wait_ready(url)
    asyncio.run(load(url, 2, 8))  # warm every engine's first passes
    for clients in (1, args.clients):
        result = asyncio.run(load(url, clients, args.max_tokens))
        print(json.dumps({"setup": name, **result, "rss_gib": round(rss_gib(procs), 2)}), flush=True)


@contextmanager
def nginx(port: int, upstreams: list[int]):
    root = tempfile.mkdtemp(prefix="scaleout-nginx-")
    servers = " ".join(f"server 127.0.0.1:{p};" for p in upstreams)
    with open(f"{root}/nginx.conf", "w") as f:
        f.write(NGINX_CONF.format(root=root, servers=servers, port=port))
    proc = subprocess.Popen([shutil.which("nginx"), "-p", root, "-c", f"{root}/nginx.conf"])
    try:
        yield proc
    finally:
        stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    cpus = len(os.sched_getaffinity(0))
    threads, batch = max(1, cpus // args.replicas), max(1, args.clients // args.replicas)
    print(f"{cpus} CPUs; {args.replicas} replicas of {threads} thread(s), batch {batch}; one engine of batch "
          f"{batch * args.replicas}", flush=True)

    # One thread too: on a machine shared with other work, threads of one engine wait on each other at every
    # operation, which replicas of one thread each never do.
    for engine_threads in sorted({cpus, threads}, reverse=True):
        one_engine = serve(9001, "--threads", str(engine_threads), "--max-batch-size", str(batch * args.replicas))
        try:
            measure(f"one engine, {engine_threads} thread(s)", "http://127.0.0.1:9001", [one_engine], args)
        finally:
            stop(one_engine)

    ray = serve(9002, "--replicas", str(args.replicas), "--max-batch-size", str(batch))
    try:
        measure(f"ray serve, {args.replicas} replicas", "http://127.0.0.1:9002", [ray], args)
    finally:
        stop(ray)

    if shutil.which("nginx") is None:
        print("nginx not installed: its row is not measured")
        return
    ports = [9011 + i for i in range(args.replicas)]
    plain = [serve(port, "--threads", str(threads), "--max-batch-size", str(batch)) for port in ports]
    try:
        for port in ports:
            wait_ready(f"http://127.0.0.1:{port}")
        with nginx(9003, ports) as proxy:
            measure(f"nginx least_conn, {args.replicas} servers", "http://127.0.0.1:9003", [*plain, proxy], args)
    finally:
        stop(*plain)


if __name__ == "__main__":
    main()
