"""`speculant serve --replicas N`: the checks before anything starts, session affinity, the merged
/metrics, and (slow, with Ray installed) two real replicas on a local Ray cluster behind Ray's proxy.

Ray opens some ports on every interface, so the Ray tests run only in a loopback-only network namespace:
    unshare -n sh -c 'ip link set lo up && pytest -m slow tests/server/test_replicas.py'
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from ray_cluster import AUTH, free_port, need_ray_on_loopback, two_replicas, wait_until

from speculant.errors import SpeculantError
from speculant.server.scaleout.replicas import (
    REPLICA_HEADER,
    REPLICA_LOST,
    SESSION_HEADER,
    EndLostResponses,
    check_replicas,
    cpu_count,
    label_sample,
    merge_metrics,
    session_replica,
    wait_for_replicas,
)

prom_parser = pytest.importorskip("prometheus_client.parser")

# -- before anything starts ---------------------------------------------------------------------


def test_zero_replicas_is_refused():
    with pytest.raises(SpeculantError, match="--replicas must be at least 1, got 0"):
        check_replicas(0, None, 2)


def test_more_replicas_than_cpus_is_refused():
    with pytest.raises(SpeculantError, match="--replicas 3 with 1 thread.* needs 3 CPUs; this machine has 2"):
        check_replicas(3, None, 2)
    with pytest.raises(SpeculantError, match="needs 4 CPUs"):
        check_replicas(2, 2, 2)


def test_each_replica_gets_its_share_of_the_cpus():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    assert check_replicas(2, None, 8) == 4
    assert check_replicas(2, 3, 8) == 3
    assert check_replicas(3, None, None) == 1  # an existing cluster places them itself


def test_one_replica_needs_no_ray(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert check_replicas(1, None, 2) == 2
    with pytest.raises(SpeculantError, match=r"not installed: pip install 'speculant\[ray\]'"):
        check_replicas(2, None, 2)


def speculant(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "speculant.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


@pytest.mark.parametrize("replicas, extra, says", [
    ("0", [], "--replicas must be at least 1, got 0"),
    (str(cpu_count() + 1), [], f"this machine has {cpu_count()}"),
    # Each replica loads its model inside Ray: a wrong path is caught before Ray starts, not as Ray's traceback.
    ("2", ["/nonexistent/model.gguf"], "model path not found: /nonexistent/model.gguf"),
    ("2", ["--speculative-config", '{"method": "draft_model", "model": "/no/draft.gguf", "num_speculative_tokens": 4}'],
     "model path not found: /no/draft.gguf"),
], ids=["zero", "more than CPUs", "model path", "draft path"])
def test_bad_replica_counts_fail_with_one_line_before_loading(replicas, extra, says):
    proc = speculant("serve", *extra, "--replicas", replicas, "--port", str(free_port()))
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and says in lines[0]


@pytest.mark.slow
def test_a_model_no_replica_can_load_fails_with_its_own_error(tmp_path):
    need_ray_on_loopback("tests/server/test_replicas.py")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    proc = speculant("serve", str(bad), "--replicas", "2", "--port", str(free_port()))
    out, err = proc.communicate(timeout=300)
    last = [line for line in err.splitlines() if line.strip()][-1]
    says = f"error: the replicas did not start: {bad}: not a GGUF file (bad magic bytes)."
    assert proc.returncode == 1 and last == says, err[-3000:]


def test_a_failed_deployment_says_what_its_replicas_raised(monkeypatch):
    pytest.importorskip("ray.serve", reason="ray is not installed")
    from types import SimpleNamespace

    from speculant.server import ray_serve

    def status(message: str):
        deployment = SimpleNamespace(message=message)
        app = SimpleNamespace(message="Failed to update the deployments ['EngineReplica'].",
                              deployments={"EngineReplica": deployment})
        return lambda: SimpleNamespace(applications={"speculant": app})

    ours = "Traceback (most recent call last):\n  ...\nspeculant.errors.SpeculantError: x.gguf: not a GGUF file"
    monkeypatch.setattr(ray_serve.serve, "status", status(ours))
    assert ray_serve.replica_error("speculant") == "x.gguf: not a GGUF file"
    monkeypatch.setattr(ray_serve.serve, "status", status("Traceback ...\nMemoryError: out of memory"))
    assert ray_serve.replica_error("speculant") == "MemoryError: out of memory"
    monkeypatch.setattr(ray_serve.serve, "status", lambda: SimpleNamespace(applications={}))
    assert ray_serve.replica_error("speculant") is None


# -- health --------------------------------------------------------------------------------------


class EngineThatDies:
    def __init__(self):
        from types import SimpleNamespace

        self.scheduler = SimpleNamespace(policy=None)  # the worker sets its round robin there

    def has_unfinished(self) -> bool:
        raise RuntimeError("the engine thread's bug")


def dead_worker():
    from speculant.server.bridge.worker import EngineWorker
    from speculant.server.http.metrics import ServerMetrics

    worker = EngineWorker(EngineThatDies(), ServerMetrics("m"))
    worker.start()
    worker._thread.join(5)
    return worker


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_rays_health_check_fails_once_the_engine_thread_died():
    pytest.importorskip("ray.serve", reason="ray is not installed")
    from types import SimpleNamespace

    from speculant.server.scaleout.ray_serve import EngineReplica

    worker = dead_worker()
    assert not worker.alive
    with pytest.raises(RuntimeError, match="the engine thread has died"):
        EngineReplica.check_health(SimpleNamespace(server=SimpleNamespace(worker=worker)))


# -- session affinity ---------------------------------------------------------------------------


def test_a_session_keeps_its_replica():
    replicas = ["a1b2", "c3d4", "e5f6"]
    assert len({session_replica("user-42", replicas) for _ in range(10)}) == 1
    assert session_replica("user-42", replicas) == session_replica("user-42", list(reversed(replicas)))


def test_sessions_spread_and_only_a_leaving_replicas_sessions_move():
    replicas = [f"r{i}" for i in range(4)]
    sessions = [f"s{i}" for i in range(400)]
    home = {s: session_replica(s, replicas) for s in sessions}
    counts = [list(home.values()).count(r) for r in replicas]
    assert min(counts) > 60, counts  # 100 each on average
    after = {s: session_replica(s, replicas[:3]) for s in sessions}
    assert all(after[s] == home[s] for s in sessions if home[s] != "r3")
    assert {after[s] for s in sessions if home[s] == "r3"} == set(replicas[:3])


# -- one /metrics -------------------------------------------------------------------------------


def test_waiting_for_replicas_counts_the_replicas_the_proxy_routes_to():
    """A stand-in proxy: 404 before its route exists, then replicas as its router knows them."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = iter([None, None, "r1", "r1", "r1", "r2"])

    class Proxy(BaseHTTPRequestHandler):
        def do_GET(self):
            replica = next(answers, "r1")
            self.send_response(404 if replica is None else 200)
            if replica:
                self.send_header(REPLICA_HEADER, replica)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert wait_for_replicas(url, 2, 30) == {"r1", "r2"}
        assert wait_for_replicas(url, 3, 0.5) == {"r1"}  # a replica never routed to: the timeout, not a hang
    finally:
        server.shutdown()


def test_label_sample_puts_the_replica_first():
    assert label_sample('speculant:x_total{model_name="m"} 3.0', "r1") == \
        'speculant:x_total{replica="r1",model_name="m"} 3.0'
    assert label_sample("speculant:y 1.0", "r1") == 'speculant:y{replica="r1"} 1.0'
    assert label_sample("speculant:z{} 1.0", 'a"b') == 'speculant:z{replica="a\\"b"} 1.0'


def replica_metrics(prompt_tokens: int, finished: int) -> str:
    from speculant.server.http.metrics import ServerMetrics

    m = ServerMetrics("smollm", num_speculative_tokens=2)
    m.observe_admitted(prompt_tokens)
    for _ in range(finished):
        m.observe_finished("length", 0.5)
    return m.render().decode()


def test_merged_metrics_parse_and_add_up():
    text = merge_metrics({"r1": replica_metrics(10, 3), "r2": replica_metrics(7, 2)})
    families = {f.name: f for f in prom_parser.text_string_to_metric_families(text)}
    prompt = families["speculant:prompt_tokens"].samples
    assert {s.labels["replica"]: s.value for s in prompt} == {"r1": 10, "r2": 7}
    finished = [s for s in families["speculant:request_success"].samples if s.labels["finished_reason"] == "length"]
    assert sum(s.value for s in finished) == 5
    e2e = [s for s in families["speculant:e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.value for s in e2e) == [2, 3]
    # One header per family, even with two replicas' samples under it.
    assert text.count("# TYPE speculant:prompt_tokens_total counter") == 1


def test_no_replicas_no_metrics():
    assert merge_metrics({}) == ""


# -- a replica lost mid-request, as Ray's proxy sees it --------------------------------------------


def through_proxy(*sent: dict) -> list[dict]:
    """What a client receives when the proxy gives EndLostResponses these messages, then nothing more."""
    async def proxy(scope, receive, send):
        for message in sent:
            await send(message)

    received: list[dict] = []

    async def send(message):
        received.append(message)

    asyncio.run(EndLostResponses(proxy)({"type": "http"}, None, send))
    return received


SSE_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def test_a_cut_stream_ends_with_an_error_event_and_done():
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    received = through_proxy(SSE_START, chunk)
    assert received[:2] == [SSE_START, chunk]
    last = received[-1]
    assert last["more_body"] is False and last["body"].endswith(b"\n\ndata: [DONE]\n\n")
    error = json.loads(last["body"].split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["message"] == REPLICA_LOST and error["code"] == "replica_lost"


def test_a_response_never_begun_is_a_503_with_the_openai_body():
    start, body = through_proxy()
    assert start["status"] == 503 and (b"content-type", b"application/json") in start["headers"]
    assert json.loads(body["body"])["error"]["type"] == "service_unavailable"


def test_finished_responses_pass_untouched():
    messages = [SSE_START, {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}]
    assert through_proxy(*messages) == messages


# -- two real replicas on Ray Serve (slow) ------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(smollm_path):
    """`speculant serve --replicas 2` on loopback; yields (base URL, process)."""
    with two_replicas(smollm_path, "tests/server/test_replicas.py",
                  ["--max-model-len", "512", "--shutdown-timeout", "20"],
                  lambda url: len(replicas_reporting(url)) == 2, 240) as running:
        yield running


def scrape(url: str) -> list:
    try:
        r = httpx.get(f"{url}/metrics", headers=AUTH, timeout=5)
    except httpx.HTTPError:
        return []
    return list(prom_parser.text_string_to_metric_families(r.text)) if r.status_code == 200 else []


def replicas_reporting(url: str) -> set[str]:
    return {s.labels["replica"] for f in scrape(url) for s in f.samples if "replica" in s.labels}


def total(url: str, name: str, **labels) -> dict[str, float]:
    """Each replica's value of one series."""
    return {s.labels["replica"]: s.value for f in scrape(url) for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                            headers: dict | None = None) -> tuple[str, str | None, dict | None]:
    """(text, replica that answered, error body or None) of one streamed greedy completion."""
    body = {"model": "smollm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, error = "", None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers={**AUTH, **(headers or {})}) as r:
        replica = r.headers.get(REPLICA_HEADER)
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    error = event["error"]
                else:
                    text += event["choices"][0]["text"]
        except httpx.HTTPError as e:
            error = {"transport": repr(e)}
    return text, replica, error


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Roses are red,", "1, 2, 3, 4,",
           "Once upon a time", "The best way to learn", "import numpy as np\n", "Water boils at"]


@pytest.fixture(scope="module")
def lone_answers(smollm_path):
    """What one engine, alone, writes greedily for each prompt (configured as `serve` configures it)."""
    import torch

    from speculant.arguments import engine_from_args
    from speculant.cli import build_parser
    from speculant.config import SamplingParams

    torch.set_num_threads(1)  # as each replica runs: the same sums in the same order
    engine = engine_from_args(build_parser().parse_args(["serve", str(smollm_path), "--max-model-len", "512"]))
    answers = []
    for prompt in PROMPTS:
        seq = engine.add_request(engine.tokenizer.encode(prompt), SamplingParams(temperature=0, max_tokens=16))
        while not seq.finished:
            engine.step()
        answers.append(engine.tokenizer.decode(seq.output_ids))
    return answers


@pytest.mark.slow
def test_hardening_is_unchanged_through_rays_proxy(cluster):
    url, _ = cluster
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "hi"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "the model 'nope' does not exist; this server serves 'smollm'", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    r = httpx.post(f"{url}/v1/completions", content=b"{", headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(f"{url}/metrics").status_code == 401
    r = httpx.get(f"{url}/metrics", headers={**AUTH, "Host": "evil.example"})
    assert r.status_code == 403


@pytest.mark.slow
def test_16_concurrent_streams_match_one_engine_and_the_metrics_add_up(cluster, lone_answers):
    url, _ = cluster
    before = total(url, "speculant:request_success_total", finished_reason="length")

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(stream_completion(client, url, PROMPTS[i % 8], 16) for i in range(16)))

    results = asyncio.run(all_at_once())
    assert [error for _, _, error in results] == [None] * 16
    assert [text for text, _, _ in results] == [lone_answers[i % 8] for i in range(16)]
    served_by = {replica for _, replica, _ in results}
    assert len(served_by) == 2, "one replica served every request"

    def added_up() -> bool:
        after = total(url, "speculant:request_success_total", finished_reason="length")
        return sum(after.values()) - sum(before.values()) == 16 and set(after) >= served_by

    wait_until(added_up, 10, "the metrics of 16 requests")


@pytest.mark.slow
def test_a_session_header_keeps_a_replica(cluster):
    url, _ = cluster

    def replica_for(session: str) -> str:
        r = httpx.post(f"{url}/v1/completions", json={"model": "smollm", "prompt": "hi", "max_tokens": 1},
                       headers={**AUTH, SESSION_HEADER: session}, timeout=60)
        assert r.status_code == 200
        return r.headers[REPLICA_HEADER]

    assert len({replica_for("alice") for _ in range(6)}) == 1
    assert len({replica_for(f"user-{i}") for i in range(16)}) == 2  # 2**-15 to fail by chance


def replica_pids() -> list[int]:
    psutil = pytest.importorskip("psutil")
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any("ServeReplica:speculant:EngineReplica" in part for part in p.info["cmdline"] or [])]


@pytest.mark.slow
def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(cluster):
    url, _ = cluster
    before = replicas_reporting(url)
    pids = replica_pids()
    assert len(pids) == 2, pids

    async def served(client: httpx.AsyncClient, prompt: str) -> str | None:
        """A request sent after the kill; one retry, as the error says, for one Ray routed to the dead
        replica before it noticed."""
        for _ in range(2):
            _, _, error = await stream_completion(client, url, prompt, 8)
            if error is None or error.get("code") != "replica_lost":
                return error
        return error

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            # More streams than one replica has slots (8): both replicas hold some.
            streams = [asyncio.ensure_future(stream_completion(client, url, PROMPTS[i % 8], 200)) for i in range(12)]
            await asyncio.sleep(3)  # every stream running
            os.kill(pids[0], signal.SIGKILL)
            after_kill = await asyncio.gather(*(served(client, p) for p in PROMPTS[:4]))
            return await asyncio.gather(*streams), after_kill

    results, after_kill = asyncio.run(run())
    failed = [error for _, _, error in results if error is not None]
    print(f"{len(failed)} of the {len(results)} streams were on the killed replica; their errors: {failed[:1]}")
    assert failed, "no in-flight request was on the killed replica"
    assert len(failed) < len(results), "the surviving replica's requests failed too"
    assert all(error.get("code") == "replica_lost" for error in failed), failed
    assert after_kill == [None] * 4, "the surviving replica stopped serving"
    wait_until(lambda: len(replicas_reporting(url) - before) == 1 and len(replica_pids()) == 2, 120,
               "Ray to bring the replica back")


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(cluster):
    url, proc = cluster

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.ensure_future(stream_completion(client, url, p, 48)) for p in PROMPTS[:4]]
            await asyncio.sleep(1.5)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    assert [error for _, _, error in results] == [None] * 4
    assert all(text for text, _, _ in results)
    assert proc.wait(90) == 0
