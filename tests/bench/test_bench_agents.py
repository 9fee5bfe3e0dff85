"""The agent workload bench's own arithmetic: the waits a stream sees, and a fresh server's cache."""

from __future__ import annotations

import os

import pytest

from speculant.bench import agents
from speculant.bench.agents import Call, step_spans, summarize


def test_a_steps_chunks_are_one_wait_and_the_waits_between_steps_are_kept():
    # Step 1 sends 3 chunks within a millisecond, step 2 one chunk 50 ms later, step 3 two chunks 1 s later.
    times = [10.0, 10.0004, 10.0008, 10.05, 11.05, 11.0501]
    spans = step_spans(times)
    assert spans == [(10.0, 10.05), (10.05, 11.05)]  # from one step's first chunk to the next's


def test_summarize_compares_later_calls_and_the_whole_wall_time():
    ours = [Call(1.0, 2.0, 10, "a"), Call(0.2, 1.0, 10, "b"), Call(0.1, 1.0, 10, "c")]
    theirs = [Call(2.0, 3.0, 10, "a"), Call(0.4, 2.0, 10, "x"), Call(0.4, 2.0, 10, "c")]
    s = summarize("conversation", ours, theirs)
    # Calls 2 and 3: 0.5 and 0.25 of the peer's wait; the first call is left out.
    assert s["ttft_ratio_later_calls_geomean"] == pytest.approx((0.5 * 0.25) ** 0.5)
    assert s["wall_speedup"] == pytest.approx(7.0 / 4.0)
    assert s["same_text"] == [True, False, True]


def test_a_fresh_server_sees_the_converted_models_but_no_cost_curve(tmp_path, monkeypatch):
    (tmp_path / "cost_curves").mkdir()
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "model.safetensors").write_bytes(b"x")
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    env = agents.fresh_cache()
    fresh = env["SPECULANT_CACHE"]
    assert fresh != str(tmp_path) and sorted(os.listdir(fresh)) == ["gguf"]
    assert os.path.realpath(os.path.join(fresh, "gguf")) == str(tmp_path / "gguf")


def test_the_fleet_size_is_read_from_serves_arguments():
    assert agents.replica_count(("--replicas", "2", "--routing", "load")) == 2
    assert agents.replica_count(("--routing", "prefix", "--replicas=3")) == 3
    assert agents.replica_count(("--max-model-len", "2048")) == 1
