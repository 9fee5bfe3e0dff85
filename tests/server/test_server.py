"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client.

One module-scoped server (the bundled SmolLM2, n-gram speculation, an API key) serves most tests;
the CLI's startup errors and SIGTERM handling run `speculant serve` as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from conftest import save_tiny, server_engine, wait_until_healthy

openai = pytest.importorskip("openai")
prom_parser = pytest.importorskip("prometheus_client.parser")

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
GREEDY = dict(temperature=0)


@contextmanager
def serving(app, shutdown_timeout_s: float = 5):
    """uvicorn on a free loopback port in a background thread; yields the base URL and the server."""
    from speculant.server.http.app import Server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(app, log_level="warning"), shutdown_timeout_s=shutdown_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextmanager
def live_server(app):
    with serving(app) as (base, _):
        yield base


@contextmanager
def openai_client(engine, name: str = "smollm"):
    """The OpenAI client against a live server of `engine` under `name`, as a user's code would hold it."""
    import openai

    from speculant.server.http.app import create_app

    with live_server(create_app(engine, [name])) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def slow_steps(monkeypatch, engine, seconds: float = 0.05) -> None:
    """Every engine step takes at least `seconds`: a request of N tokens then outlasts N / (k + 1) × seconds on
    any machine, which lets a test race it against a timeout without racing the machine's speed."""
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(engine, "step", step)


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def url(engine):
    from speculant.server.http.app import create_app

    with live_server(create_app(engine, ["smollm"], api_key=API_KEY)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def scrape(url: str) -> dict[tuple, float]:
    """/metrics as {(sample name, frozenset of labels except model_name): value}."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for family in prom_parser.text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def grew(before: dict, after: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


# -- completions, chat, streaming, usage --------------------------------------------------------


def test_completion_usage_and_speculative_stats(client, engine):
    prompt = "The capital of France is"
    out = client.completions.create(model="smollm", prompt=prompt, max_tokens=8, extra_body={
        "return_token_ids": True}, **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.text and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == len(choice.model_extra["token_ids"]) <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert engine.tokenizer.decode(choice.model_extra["token_ids"]).startswith(choice.text)
    stats = out.model_extra["speculative_stats"]
    assert stats["method"] == "ngram" and stats["num_speculative_tokens"] == 4
    assert stats["target_passes"] >= 1 and len(stats["per_position_acceptance"]) <= 4


def test_chat_completion(client, engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(model="smollm", messages=messages, max_completion_tokens=10,
                                         **GREEDY)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode_chat(messages))
    assert 1 <= out.usage.completion_tokens <= 10
    assert out.model_extra["speculative_stats"]["method"] == "ngram"


def test_completion_stream_joins_to_the_unstreamed_text(client):
    args = dict(model="smollm", prompt="Count: one, two, three, four,", max_tokens=16, **GREEDY)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len(texts) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    same = {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert usage_chunk.usage.model_dump(include=same) == whole.usage.model_dump(include=same)
    # The same prompt again: all of it but its last token comes from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    assert usage_chunk.model_extra["speculative_stats"]["target_passes"] >= 1


def test_chat_stream_matches_and_names_the_role_first(client):
    args = dict(model="smollm", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12,
                **GREEDY)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # Without include_usage there is no usage chunk: the last chunk carries the speculative statistics.
    assert all(c.usage is None for c in chunks) and chunks[-1].model_extra["speculative_stats"]


def test_n_choices_seed_and_stop(client):
    args = dict(model="smollm", prompt="Once upon a time", max_tokens=6, n=2, temperature=0.8, seed=7)
    first, again = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    args = dict(model="smollm", prompt="The capital of France is", max_tokens=8, **GREEDY)
    stop = client.completions.create(**args).choices[0].text.strip().split()[0]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == ["smollm"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


# -- continuous batching ------------------------------------------------------------------------


def test_32_concurrent_streams_return_the_lone_text(client, url):
    prompts = ["The capital of France is", "def fibonacci(n):", "Roses are red,", "1, 2, 3, 4,"]
    lone = [client.completions.create(model="smollm", prompt=p, max_tokens=8, **GREEDY).choices[0].text
            for p in prompts]
    before = scrape(url)

    async def one(aclient, prompt: str) -> str:
        stream = await aclient.completions.create(model="smollm", prompt=prompt, max_tokens=8, stream=True,
                                                  **GREEDY)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(32)))

    texts = asyncio.run(all_at_once())
    assert texts == [lone[i % 4] for i in range(32)]
    after = scrape(url)
    steps = grew(before, after, "speculant:iteration_batch_size_count")
    small = grew(before, after, "speculant:iteration_batch_size_bucket", le="4.0")
    assert steps > small, "the 32 requests never ran in one batch of more than 4"
    assert steps < 32 * 8, "requests ran one after another"


# -- bad input ----------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]
BAD_INPUT = [
    # (id, path, body, status, param, code)
    ("malformed json", COMPLETIONS, '{"prompt": "hi", ', 400, None, None),
    ("not an object", COMPLETIONS, "[1, 2]", 400, None, None),
    ("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400, "prompt", None),
    ("prompt wrong type", COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
    ("max_tokens string", COMPLETIONS, {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens", None),
    ("temperature string", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ("zero max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("oversized max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt longer than context", COMPLETIONS, {"prompt": "word " * 400}, 400, "prompt",
     "context_length_exceeded"),
    ("empty prompt list", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("token id out of vocab", COMPLETIONS, {"prompt": [10**7]}, 400, None, None),
    ("negative temperature", COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400, "temperature", None),
    ("top_p zero", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("top_p above one", COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("top_k below -1", COMPLETIONS, {"prompt": "hi", "top_k": -2}, 400, "top_k", None),
    ("min_p above one", COMPLETIONS, {"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    ("n zero", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n", None),
    ("empty stop string", COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("logprobs too many", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("chat top_logprobs negative", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs", None),
    ("penalty unsupported", COMPLETIONS, {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty",
     None),
    ("stream_options without stream", COMPLETIONS, {"prompt": "hi", "stream_options": {}}, 400,
     "stream_options", None),
    ("empty messages", CHAT, {"messages": []}, 400, "messages", None),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, "messages", None),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
    ("chat max_completion_tokens negative", CHAT, {"messages": HELLO, "max_completion_tokens": -3}, 400,
     "max_completion_tokens", None),
    ("chat unknown model", CHAT, {"model": "nope", "messages": HELLO}, 404, "model", "model_not_found"),
]


def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(url, client):
    for name, path, body, status, param, code in BAD_INPUT:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(url + path, content=content, headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], name
        assert (error["param"], error["code"]) == (param, code), (name, error)
    r = httpx.get(f"{url}/v1/no-such-route", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert client.completions.create(model="smollm", prompt="Hello", max_tokens=2, **GREEDY).choices[0].text


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm", prompt="hi", max_tokens=4, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HELLO)


# -- metrics, API key, disconnects --------------------------------------------------------------


def test_metrics_move_with_traffic(client, url):
    before = scrape(url)
    out = client.completions.create(model="smollm", prompt="a b c d a b c d a b c d a b c", max_tokens=12,
                                    **GREEDY)
    after = scrape(url)

    reason = out.choices[0].finish_reason
    assert grew(before, after, "speculant:request_success_total", finished_reason=reason) == 1
    assert grew(before, after, "speculant:generation_tokens_total") == out.usage.completion_tokens
    assert grew(before, after, "speculant:prompt_tokens_total") == out.usage.prompt_tokens
    assert grew(before, after, "speculant:time_to_first_token_seconds_count") == 1
    assert grew(before, after, "speculant:e2e_request_latency_seconds_count") == 1
    stats = out.model_extra["speculative_stats"]
    assert stats["num_drafts"] > 0, "a repetitive prompt should make the n-gram proposer draft"
    assert grew(before, after, "speculant:spec_decode_num_drafts_total") == stats["num_drafts"]
    assert grew(before, after, "speculant:spec_decode_num_draft_tokens_total") == stats["num_draft_tokens"]
    accepted = grew(before, after, "speculant:spec_decode_num_accepted_tokens_total")
    assert accepted == stats["num_accepted_tokens"] > 0
    per_pos = [grew(before, after, "speculant:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(4)]
    assert sum(per_pos) == accepted
    assert metric(after, "speculant:num_requests_running") == 0
    assert metric(after, "speculant:num_requests_waiting") == 0


def test_api_key_is_enforced(url):
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    # Everything but the health check needs the key: the metrics, the docs and the schema too.
    for path in ("/v1/models", "/metrics", "/docs", "/redoc", "/openapi.json", "/v1/no-such-route"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(url + path, headers=AUTH).status_code in (200, 404), path
    assert httpx.get(f"{url}/health").status_code == 200


def wait_until_aborted(url: str, before: dict, timeout_s: float = 30.0) -> dict:
    """/metrics once the abort is counted and nothing runs (the client may leave before its request is even
    admitted: idle alone would not say the abort happened)."""
    deadline = time.time() + timeout_s
    while True:
        samples = scrape(url)
        aborted = grew(before, samples, "speculant:request_success_total", finished_reason="abort")
        if (aborted and metric(samples, "speculant:num_requests_running") == 0) or time.time() > deadline:
            return samples
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts_the_request(url, engine, monkeypatch, stream):
    slow_steps(monkeypatch, engine)  # 200 tokens take at least 40 steps (k = 4): 2 s
    before = scrape(url)
    body = {"prompt": "Tell me a very long story.", "max_tokens": 200, "ignore_eos": True, "stream": stream,
            **GREEDY}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    after = wait_until_aborted(url, before)
    assert metric(after, "speculant:num_requests_running") == 0
    assert grew(before, after, "speculant:request_success_total", finished_reason="abort") == 1
    assert grew(before, after, "speculant:generation_tokens_total") < 200


# -- the CLI: startup errors, SIGTERM -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculant(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "speculant.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent/model"], "model path not found"),
    (["--speculative-config", "{bad"], "invalid JSON"),
], ids=["missing model", "bad speculative config"])
def test_startup_errors_fail_with_one_line_before_binding(args, says):
    port = free_port()
    proc = speculant("serve", *args, "--port", str(port))
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and says in lines[0]
    assert "Uvicorn running" not in out + err


def test_shutdown_ends_in_flight_requests_with_a_clean_error(tmp_path, monkeypatch):
    """The drain gives in-flight requests 0.2 s, then ends them with an error event, not a cut connection."""
    from speculant.llm import build_engine
    from speculant.server.http.app import create_app

    engine = build_engine(str(save_tiny(tmp_path / "tiny", seed=5)), max_model_len=512)
    slow_steps(monkeypatch, engine)  # 500 tokens, one a step: 25 s
    body = {"prompt": [1, 5, 9, 5, 9], "max_tokens": 500, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **GREEDY}
    events = []
    with serving(create_app(engine, ["tiny"]), shutdown_timeout_s=0.2) as (base, server):
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    server.should_exit = True
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-2]) < 500


def test_sigterm_drains_and_exits_as_terminated(tmp_path):
    """`speculant serve` under SIGTERM: the stream in flight ends cleanly either way (finished within the
    0.2 s drain, or cut with an error event), then [DONE], and the process exits as terminated."""
    model = save_tiny(tmp_path / "tiny", seed=5)
    port = free_port()
    proc = speculant("serve", str(model), "--port", str(port), "--ngram", "-k", "2", "--max-model-len", "512",
                     "--shutdown-timeout", "0.2", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, base, timeout_s=60)
        body = {"prompt": [1, 5, 9, 5, 9], "max_tokens": 500, "ignore_eos": True, "stream": True,
                "return_token_ids": True, **GREEDY}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)
        # uvicorn drains, then re-raises the signal with its default action: supervisors see a SIGTERM exit.
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["type"] == "service_unavailable" and "shutting down" in last["error"]["message"]
    else:
        assert last["choices"][0]["finish_reason"] == "length"


def test_logprobs_in_completions_and_chat(client):
    c = client.completions.create(model="smollm", prompt="The capital of France is", max_tokens=6, logprobs=2,
                                  **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert "".join(lp.tokens) == c.choices[0].text
    # greedy: the chosen token is the most likely one, its logprob the top one
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-5)
    chat = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
               for t in content)
    streamed = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, logprobs=True, stream=True, **GREEDY)
    tokens = [t.token for chunk in streamed for choice in chunk.choices if choice.logprobs
              for t in choice.logprobs.content]
    assert tokens == [t.token for t in content]


def test_answer_history_spans_requests(smollm_path):
    """With "history_tokens" the server's proposer keeps answers across requests: the same question
    again gets the same answer, drafted from the first one."""
    from speculant.llm import build_engine
    from speculant.server.http.app import create_app

    spec = {"method": "ngram", "num_speculative_tokens": 6, "history_tokens": 100_000}
    engine = build_engine(str(smollm_path), speculative_config=spec, max_model_len=MAX_MODEL_LEN)
    with live_server(create_app(engine, ["smollm"], api_key=API_KEY)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        first, again = (client.chat.completions.create(model="smollm", messages=messages, max_tokens=40, **GREEDY)
                        for _ in range(2))
    assert again.choices[0].message.content == first.choices[0].message.content
    stats = [out.model_extra["speculative_stats"] for out in (first, again)]
    assert stats[0]["method"] == "ngram+history"
    assert stats[1]["target_passes"] < stats[0]["target_passes"] / 2
