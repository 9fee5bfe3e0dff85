"""The server's side of the prefix cache and of its queue: cached tokens in each response's usage and in
/metrics, the same answers from a cached prefix as cold, a 429 with Retry-After past the waiting queue."""

from __future__ import annotations

import random
import threading

import httpx
import pytest
from conftest import save_tiny
from test_server import API_KEY, AUTH, grew, live_server, metric, scrape

from speculant.llm import build_engine
from speculant.server.http.app import create_app
from speculant.server.http.guard import ServerLimits


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("served") / "tiny", seed=9, num_hidden_layers=2)


def complete(base: str, prompt: list[int], max_tokens: int = 12) -> dict:
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_and_metrics_report_cached_tokens(folder):
    rng = random.Random(0)
    system = [rng.randrange(3, 96) for _ in range(60)]
    engine = build_engine(str(folder), dtype="float32", max_batch_size=2, max_model_len=256)
    with live_server(create_app(engine, ["tiny"], API_KEY)) as base:
        before = scrape(base)
        first = complete(base, system + [5, 6])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = complete(base, system + [7, 8, 9])
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(system)
        # The next turn of the first conversation: its prompt, its answer, a new message.
        turn = system + [5, 6] + first["choices"][0]["token_ids"] + [10, 11]
        third = complete(base, turn)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(system) + 2 + 12 - 1
        after = scrape(base)
    hits = grew(before, after, "speculant:prefix_cache_hits_total")
    assert hits == sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second, third))
    assert grew(before, after, "speculant:prefix_cache_queries_total") == sum(
        r["usage"]["prompt_tokens"] - 1 for r in (first, second, third))
    assert metric(after, "speculant:prefix_cache_cached_tokens") > 0
    assert 0 < metric(after, "speculant:prefix_cache_hit_rate") < 1
    # Cold, on an engine without the cache: the same answer to the third call.
    cold = build_engine(str(folder), dtype="float32", max_batch_size=2, max_model_len=256, prefix_cache_bytes=0)
    with live_server(create_app(cold, ["tiny"], API_KEY)) as base:
        again = complete(base, turn)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["token_ids"] == third["choices"][0]["token_ids"]


def test_a_full_queue_answers_429_with_retry_after(folder, monkeypatch):
    engine = build_engine(str(folder), dtype="float32", max_batch_size=1, max_model_len=256)
    gate = threading.Event()
    real = engine.step

    def held_step():  # the engine holds every request until the test has filled the queue
        gate.wait(30)
        return real()

    monkeypatch.setattr(engine, "step", held_step)
    app = create_app(engine, ["tiny"], API_KEY, ServerLimits(max_waiting_requests=1))
    with live_server(app) as base:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        with httpx.Client(headers=AUTH, timeout=60) as http:
            pending = [threading.Thread(target=http.post, args=(f"{base}/v1/completions",), kwargs={"json": body})
                       for _ in range(2)]  # one in the batch row, one waiting
            for t in pending:
                t.start()
            server = app.state.server
            while len(server.worker.in_flight) < 2:
                threading.Event().wait(0.01)
            refused = http.post(f"{base}/v1/completions", json=body)
            gate.set()
            for t in pending:
                t.join(60)
            after = http.post(f"{base}/v1/completions", json=body)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["Retry-After"]) >= 1
    assert after.status_code == 200
