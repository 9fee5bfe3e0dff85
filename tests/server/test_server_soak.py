"""The server's long checks (the `slow` suite): schema-driven fuzzing of every operation /openapi.json
declares, and a soak of mixed traffic.

    pytest -m slow tests/server/test_server_soak.py
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest
from test_server import GREEDY, live_server

pytestmark = pytest.mark.slow
psutil = pytest.importorskip("psutil")

FUZZ_MODEL_LEN = 64
FUZZ_EXAMPLES = int(os.environ.get("SPECULANT_FUZZ_EXAMPLES", 300))  # per POST operation and mode


@pytest.fixture(scope="module")
def fuzz_url(smollm_path):
    """A server whose limits keep any one schema-generated request small: the fuzzing exercises validation
    and the guard, not the CPU."""
    from speculant.llm import build_engine
    from speculant.server.http.app import create_app
    from speculant.server.http.guard import ServerLimits

    engine = build_engine(str(smollm_path), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                          max_batch_size=8, max_model_len=FUZZ_MODEL_LEN)
    limits = ServerLimits(max_sequences=4, request_timeout_s=5.0, max_body_bytes=256 * 1024)
    with live_server(create_app(engine, ["smollm"], limits=limits)) as base:
        yield base


def test_schemathesis_finds_no_server_error(fuzz_url):
    """≥ 1,000 schema-generated requests, valid and invalid, against every operation: none gets a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    sent, server_errors = [], []
    for op in operations:
        post = op.method.upper() == "POST"
        # A GET here takes nothing: there is no invalid one to make.
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,):
            examples = FUZZ_EXAMPLES if post else 5
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                r = case.call(base_url=fuzz_url, timeout=60)
                sent.append(r.status_code)
                if r.status_code >= 500:
                    server_errors.append((case.operation.path, case.body, r.text))

            run()
    print(f"\nschemathesis: {len(sent)} requests, {sum(s < 300 for s in sent)} 2xx, "
          f"{sum(400 <= s < 500 for s in sent)} 4xx, {len(server_errors)} 5xx")
    assert len(sent) >= 1000
    assert not server_errors, server_errors[:3]


# -- the soak ---------------------------------------------------------------------------------------

SOAK_S = float(os.environ.get("SPECULANT_SOAK_S", 600))
CLIENTS = 16
INVALID = [
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "top_k": 2**63},
    {"prompt": "hi", "temperature": "hot"},
    {"prompt": "hi", "repetition_penalty": 1.1},
    {"prompt": [10**7]},
    {"prompt": "word " * 600},  # past the 512-token context
]


def test_soak_mixed_traffic(smollm_path):
    """16 clients for SPECULANT_SOAK_S seconds (default 600): valid streamed and unstreamed requests, invalid
    ones, and clients that hang up mid-answer. Every request gets its answer (0 lost, 0 5xx), every greedy
    answer equals its lone run, and the resident memory after warm-up stays flat."""
    from speculant.llm import build_engine
    from speculant.server.http.app import create_app

    engine = build_engine(str(smollm_path), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                          max_batch_size=16, max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "Roses are red,", "1, 2, 3, 4,",
               "Write a haiku about the sea.", "The quick brown fox"]
    counts = {"valid": 0, "invalid": 0, "hung_up": 0, "lost": 0, "5xx": 0, "mismatch": 0}
    rss: list[tuple[float, int]] = []
    why: list[str] = []  # what each lost request met
    process = psutil.Process()

    with live_server(create_app(engine, ["smollm"])) as url:
        lone = {p: httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 24, **GREEDY},
                              timeout=120).json()["choices"][0]["text"] for p in prompts}

        async def client(seed: int, deadline: float) -> None:
            rng = random.Random(seed)
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                while time.monotonic() < deadline:
                    kind = rng.choices(["valid", "stream", "invalid", "hang_up"], [4, 3, 2, 1])[0]
                    prompt = rng.choice(prompts)
                    body = {"prompt": prompt, "max_tokens": 24, **GREEDY}
                    try:
                        if kind == "valid":
                            r = await http.post("/v1/completions", json=body)
                            check(r.status_code, 200, r.json()["choices"][0]["text"] if r.status_code == 200
                                  else None, lone[prompt])
                        elif kind == "stream":
                            text, status = "", None
                            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                                status = r.status_code
                                async for line in r.aiter_lines():
                                    if line.startswith("data: {"):
                                        event = json.loads(line[6:])
                                        if "error" in event:
                                            status = 500
                                        else:
                                            text += event["choices"][0]["text"]
                            check(status, 200, text, lone[prompt])
                        elif kind == "invalid":
                            r = await http.post("/v1/completions", json=rng.choice(INVALID))
                            counts["5xx" if r.status_code >= 500 else "invalid"] += 1
                            if not 400 <= r.status_code < 500:
                                counts["lost"] += 1
                                why.append(f"invalid got {r.status_code}")
                        else:
                            long = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
                            async with http.stream("POST", "/v1/completions", json=long) as r:
                                async for line in r.aiter_lines():
                                    if line.startswith("data: {"):
                                        break  # hang up after the first chunk
                            counts["hung_up"] += 1
                    except httpx.HTTPError as e:
                        counts["lost"] += 1
                        why.append(f"{kind}: {type(e).__name__}: {e}")

        def check(status: int, want: int, text: str | None, expected: str) -> None:
            if status >= 500:
                counts["5xx"] += 1
            if status != want:
                counts["lost"] += 1
                why.append(f"status {status}")
                return
            counts["valid"] += 1
            counts["mismatch"] += text != expected

        async def sample_rss(deadline: float) -> None:
            start = time.monotonic()
            while time.monotonic() < deadline:
                rss.append((time.monotonic() - start, process.memory_info().rss))
                await asyncio.sleep(5)

        async def soak() -> None:
            deadline = time.monotonic() + SOAK_S
            await asyncio.gather(sample_rss(deadline), *(client(i, deadline) for i in range(CLIENTS)))

        asyncio.run(soak())
        health = httpx.get(f"{url}/health").json()

    # Flat: after the first fifth (allocator and caches warming up), the last fifth's mean stays within 5%.
    warm = [m for t, m in rss if t >= SOAK_S / 5]
    early, late = warm[:max(1, len(warm) // 4)], warm[-max(1, len(warm) // 4):]
    growth = sum(late) / len(late) / (sum(early) / len(early)) - 1
    print(f"\nsoak {SOAK_S:.0f}s, {CLIENTS} clients: {counts}; RSS {rss[0][1] / 2**20:.0f} MiB at start, "
          f"{early[0] / 2**20:.0f} after warm-up, {late[-1] / 2**20:.0f} at the end ({100 * growth:+.1f}%)")
    assert health == {"status": "ok"}
    assert counts["lost"] == 0 and counts["5xx"] == 0 and counts["mismatch"] == 0, (counts, why[:5])
    assert counts["valid"] > 0 and counts["invalid"] > 0 and counts["hung_up"] > 0
    assert growth < 0.05, f"RSS grew {100 * growth:.1f}% after warm-up"
