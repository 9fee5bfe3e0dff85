"""The audit's rules: which requests it samples and may audit (lossy settings excluded by name, unseeded sampling
skipped), where two decodings first differ, and the server's auditor handing re-decodes to the engine only
with a row to spare and no live request waiting."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import pytest
from conftest import save_tiny

from speculant.audit.rules import first_difference, lossy_settings, plain_params, sampled, skip_reason
from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers.ngram import NgramProposer
from speculant.server.bridge.auditor import Auditor, AuditSettings, audit_rate, audit_settings_from_args
from speculant.server.cli import add_arguments
from speculant.server.http.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_first_difference_finds_the_first_position_and_a_length_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    d = first_difference([1, 2, 3, 4], [1, 2, 9, 4])
    assert (d.position, d.speculative, d.plain) == (2, 3, 9)
    d = first_difference([1, 2, 3], [1, 2])  # plain decoding ended earlier
    assert (d.position, d.speculative, d.plain) == (2, 3, None)
    assert "position 2: speculative token 3, plain token (ended)" in d.describe()
    d = first_difference([1], [1, 7])
    assert (d.position, d.speculative, d.plain) == (1, None, 7)


def test_sampling_is_decided_by_the_request_id_at_the_rate():
    ids = [f"cmpl-{random.Random(i).getrandbits(128):032x}" for i in range(4000)]
    assert not any(sampled(i, 0.0) for i in ids) and all(sampled(i, 1.0) for i in ids)
    share = sum(sampled(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [sampled(i, 0.3) for i in ids[:50]] == [sampled(i, 0.3) for i in ids[:50]]  # the same id, the same answer
    assert all(sampled(i, 0.5) for i in ids if sampled(i, 0.1))  # a higher rate keeps every id a lower one took


@dataclass
class LossyParams(SamplingParams):
    """A request setting as a lossy variant would name it (none exists today)."""

    lossy_typical_acceptance: float = 0.0


def test_lossy_settings_are_found_by_name_and_excluded():
    assert lossy_settings({"method": "ngram", "num_speculative_tokens": 4}) == []
    assert lossy_settings({"relaxed": {"Lossy_Threshold": 0.2}, "lossy_off": False}) == ["relaxed.Lossy_Threshold"]
    assert lossy_settings(SamplingParams()) == []  # nothing today carries the name
    on = LossyParams(temperature=0, lossy_typical_acceptance=0.3)
    assert lossy_settings(on) == ["lossy_typical_acceptance"] and skip_reason(on) == "lossy"
    assert skip_reason(LossyParams(temperature=0)) is None  # named, but not in force
    assert skip_reason(GREEDY, ["speculative_config.lossy_relaxed"]) == "lossy"
    assert skip_reason(SamplingParams(temperature=0.7, seed=None)) == "unseeded"
    assert skip_reason(SamplingParams(temperature=0.7, seed=1)) is None


def test_serve_flags_name_the_lossy_settings_in_force(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--audit", "0.25", "--ngram", "--record", str(tmp_path / "r.jsonl")])
    settings = audit_settings_from_args(args)
    assert settings.rate == 0.25 and settings.lossy == [] and settings.speculative_config["method"] == "ngram"
    args.lossy_relaxed_acceptance = True  # a flag a lossy variant would add
    assert audit_settings_from_args(args).lossy == ["lossy_relaxed_acceptance"]
    assert audit_rate("0") == 0 and audit_rate("1") == 1


def test_plain_params_keep_the_request_but_its_length_and_logprobs():
    params = SamplingParams(temperature=0.8, seed=4, top_p=0.9, max_tokens=100, stop=["x"], logprobs=2)
    plain = plain_params(params, 17)
    assert (plain.temperature, plain.seed, plain.top_p, plain.stop) == (0.8, 4, 0.9, ["x"])
    assert plain.max_tokens == 17 and plain.logprobs is None and params.max_tokens == 100


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny(tmp_path_factory.mktemp("auditor") / "m", seed=6), dtype="float32")


def test_the_auditor_waits_for_a_spare_row_with_no_live_request_waiting(target):
    engine = Engine(target, proposer=NgramProposer(1, 6), num_speculative_tokens=4, max_batch_size=2,
                    max_model_len=128)
    metrics = ServerMetrics("m", engine.k)
    auditor = Auditor(engine, metrics, AuditSettings(rate=1.0))
    done = engine.generate([engine.add_request([5, 6, 7, 5, 6, 7], GREEDY, "live-0")])[0]
    auditor.offer(done, "live")
    busy = engine.add_request([3, 4], GREEDY)
    engine.step()
    waiting = engine.add_request([9, 10], GREEDY)  # a live request waits for the one free row
    auditor.admit()
    assert not auditor.running and len(auditor.backlog) == 1
    engine.step()  # the live request takes the row
    auditor.admit()
    assert not auditor.running and waiting.slot >= 0
    engine.generate([busy, waiting])
    auditor.admit()  # rows to spare, nobody waiting: the re-decode starts, in the background, without drafts
    (job,) = auditor.running.values()
    assert job.seq.background and not job.seq.speculate
    while auditor.running:
        for out in engine.step():
            if auditor.owns(out.seq):
                auditor.observe(out)
    assert metrics.audit.labels("m", "match")._value.get() == 1
    assert job.seq.output_ids == done.output_ids and job.seq.stats.num_draft_tokens == 0


def test_a_re_decode_given_up_for_live_requests_is_retried(target):
    """Live requests that need the re-decode's row preempt it; it goes back to the queue's front and runs again
    once rows are spare, MAX_TRIES times before it counts as skipped."""
    from speculant.server.bridge import auditor as audit_module

    tries = getattr(audit_module, "MAX_TRIES", 3)
    engine = Engine(target, proposer=NgramProposer(1, 6), num_speculative_tokens=4, max_batch_size=2,
                    max_model_len=128)
    metrics = ServerMetrics("m", engine.k)
    auditor = Auditor(engine, metrics, AuditSettings(rate=1.0))

    def step() -> None:
        for out in engine.step():
            if auditor.owns(out.seq):
                auditor.observe(out)

    def preempt() -> None:
        """The re-decode starts; two live requests then want both rows."""
        auditor.admit()
        (job,) = auditor.running.values()
        seq = job.seq
        step()
        live = [engine.add_request([9, 10, 11], GREEDY), engine.add_request([12, 13], GREEDY)]
        step()
        assert seq.finish_reason == "abort" and not auditor.running
        engine.generate(live)

    done = engine.generate([engine.add_request([5, 6, 7, 5, 6, 7], GREEDY, "live-0")])[0]
    auditor.offer(done, "live")
    preempt()
    assert len(auditor.backlog) == 1 and auditor.backlog[0].tries == 1
    auditor.admit()
    while auditor.running:
        step()
    assert metrics.audit.labels("m", "match")._value.get() == 1
    assert metrics.audit_skipped.labels("m", "preempted")._value.get() == 0

    auditor.offer(done, "live")
    for _ in range(tries):
        preempt()
    assert not auditor.backlog and metrics.audit_skipped.labels("m", "preempted")._value.get() == 1
