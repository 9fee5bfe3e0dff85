"""`speculant serve --replicas 2 --routing prefix` on a local Ray cluster (slow, Ray installed): a conversation's
later turns reach the replica holding its prefix, /metrics shows each replica's prefix-cache hits, and a
replica killed in the middle of conversations loses no request (each completes or fails cleanly in time).

Ray opens some ports on every interface, so these run only in a loopback-only network namespace:
    unshare -n sh -c 'ip link set lo up && pytest -m slow tests/server/test_replicas_routing.py'
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from ray_cluster import AUTH, two_replicas, wait_until

from speculant.server.scaleout.replicas import REPLICA_HEADER

prom_parser = pytest.importorskip("prometheus_client.parser")

REQUEST_LIMIT_S = 120  # a request that has neither finished nor failed by then hangs


def samples(url: str, name: str) -> list:
    try:
        r = httpx.get(f"{url}/metrics", headers=AUTH, timeout=5)
    except httpx.HTTPError:
        return []
    if r.status_code != 200:
        return []
    return [s for f in prom_parser.text_string_to_metric_families(r.text) for s in f.samples if s.name == name]


def replicas_reporting(url: str) -> set[str]:
    return {s.labels["replica"] for s in samples(url, "speculant:prompt_tokens_total")}


def replica_pids() -> list[int]:
    psutil = pytest.importorskip("psutil")
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any("ServeReplica:speculant:EngineReplica" in part for part in p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def cluster(smollm_path):
    """`speculant serve --replicas 2 --routing prefix` on loopback; yields the base URL."""
    # Imbalance 8: with 4 conversations on 2 replicas, load never overrides the prefix (the rule has its own
    # tests in test_routing.py).
    with two_replicas(smollm_path, "tests/server/test_replicas_routing.py",
                  ["--routing", "prefix", "--routing-imbalance", "8", "--max-model-len", "1024", "--shutdown-timeout",
                   "10"], lambda url: len(replicas_reporting(url)) == 2, 300) as (url, _):
        yield url


TURNS = ["Write a Python function that adds two numbers.", "Now make it add three.", "Add a docstring.",
         "Write a test for it."]


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int = 16) -> dict:
    """One streamed greedy chat turn → {text, replica, cached, error}; an error (a status, an error event, a
    cut connection) is a result, and so is running past REQUEST_LIMIT_S (`hung`)."""
    body = {"model": "smollm", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"text": "", "replica": None, "cached": 0, "error": None}

    async def run() -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
            out["replica"] = r.headers.get(REPLICA_HEADER)
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    out["error"] = {"status": r.status_code, **json.loads(raw).get("error", {})}
                except (ValueError, AttributeError):
                    out["error"] = {"status": r.status_code, "body": raw[:200].decode(errors="replace")}
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    out["error"] = event["error"]
                elif event.get("usage"):
                    out["cached"] = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                elif event.get("choices"):
                    out["text"] += event["choices"][0]["delta"].get("content") or ""

    try:
        await asyncio.wait_for(run(), REQUEST_LIMIT_S)
    except asyncio.TimeoutError:
        out["error"] = {"hung": True}
    except httpx.HTTPError as e:
        out["error"] = {"transport": repr(e)}
    return out


async def conversation(client: httpx.AsyncClient, url: str, name: str, turns: list[str], retries: int = 0,
                       max_tokens: int = 16) -> list[dict]:
    """Each turn the whole conversation so far; a turn that fails cleanly is sent again up to `retries`
    times, as its error says it may be."""
    messages, results = [{"role": "system", "content": f"You help {name} with Python. " * 6}], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        for _ in range(retries + 1):
            result = await turn(client, url, messages, max_tokens)
            results.append(result)
            if result["error"] is None:
                break
        messages.append({"role": "assistant", "content": result["text"]})
    return results


@pytest.mark.slow
def test_later_turns_reach_the_replica_holding_their_prefix(cluster):
    url = cluster

    async def run():
        async with httpx.AsyncClient(timeout=REQUEST_LIMIT_S) as client:
            return await asyncio.gather(*(conversation(client, url, f"user {i}", TURNS) for i in range(4)))

    conversations = asyncio.run(run())
    assert all(t["error"] is None for c in conversations for t in c), conversations
    homes = [[t["replica"] for t in c] for c in conversations]
    print("replicas per turn:", homes)
    assert all(len(set(h)) == 1 for h in homes), homes  # every later turn where the first one went
    assert len({h[0] for h in homes}) == 2, "the new conversations did not spread over both replicas"
    assert all(t["cached"] > 0 for c in conversations for t in c[1:])

    def counted() -> bool:
        hits = {s.labels["replica"]: s.value for s in samples(url, "speculant:prefix_cache_hits_total")}
        held = sum(s.value for s in samples(url, "speculant:routed_prefix_requests_total")
                   if s.labels["held"] == "yes")
        return len(hits) == 2 and all(v > 0 for v in hits.values()) and held >= 12

    wait_until(counted, 10, "each replica's prefix-cache hits on /metrics")


@pytest.mark.slow
def test_a_replica_killed_mid_conversations_loses_no_request(cluster):
    url = cluster
    pids = replica_pids()
    assert len(pids) == 2, pids
    before = replicas_reporting(url)

    async def run():
        async with httpx.AsyncClient(timeout=REQUEST_LIMIT_S) as client:
            talks = [asyncio.ensure_future(conversation(client, url, f"agent {i}", TURNS, retries=2, max_tokens=96))
                     for i in range(6)]
            await asyncio.sleep(4)  # every conversation under way, on both replicas
            os.kill(pids[0], signal.SIGKILL)
            return await asyncio.gather(*talks)

    started = time.perf_counter()
    conversations = asyncio.run(run())
    print(f"6 conversations in {time.perf_counter() - started:.0f}s; errors:",
          [t["error"] for c in conversations for t in c if t["error"]])
    results = [t for c in conversations for t in c]
    assert not any(t["error"] and (t["error"].get("hung") or "transport" in t["error"]) for t in results), \
        "a request hung or its connection was cut without an answer"
    failed = [t["error"] for t in results if t["error"]]
    assert failed, "no request was on the killed replica"
    assert all(e.get("code") == "replica_lost" for e in failed), failed
    # Every turn of every conversation was answered in the end (a retry after a clean error).
    assert all(len([t for t in c if t["error"] is None]) == len(TURNS) for c in conversations)
    wait_until(lambda: len(replicas_reporting(url) - before) == 1 and len(replica_pids()) == 2, 180,
               "Ray to bring the replica back")
