"""Background sequences (the lossless audit's re-decodes) take only the rows live traffic leaves: admitted after
every waiting live sequence, paused while a live prompt is fed, given up when live sequences wait for their
rows; decoded plainly (no drafts) beside speculating rows, with plain decoding's tokens."""

from __future__ import annotations

import pytest
from conftest import save_tiny

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers.ngram import NgramProposer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
REPEATS = [5, 6, 7, 8, 9] * 6  # prompt lookup finds drafts in it


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny(tmp_path_factory.mktemp("background") / "m", seed=4), dtype="float32")


def speculating(target, rows: int) -> Engine:
    return Engine(target, proposer=NgramProposer(1, 6), num_speculative_tokens=4, max_batch_size=rows,
                  max_model_len=256)


def plain(target, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = Engine(target, max_batch_size=1, max_model_len=256)
    return engine.generate([engine.add_request(prompt, params)])[0].output_ids


def test_a_live_sequence_gets_the_free_row_before_background_work(target):
    engine = speculating(target, 2)
    busy = engine.add_request([3, 4, 5], GREEDY)
    engine.step()
    background = engine.add_request(REPEATS, GREEDY, "audit", speculate=False, background=True)
    live = engine.add_request([10, 11, 12], GREEDY)  # arrives after it, one row free
    engine.step()
    assert live.slot >= 0 and background.slot == -1 and list(engine.scheduler.waiting) == [background]
    engine.generate([busy, live, background])
    assert background.output_ids == plain(target, REPEATS)


def test_background_work_is_given_up_when_live_sequences_wait_for_its_row(target):
    engine = speculating(target, 2)
    busy = engine.add_request([3, 4, 5], GREEDY)
    background = engine.add_request(REPEATS, GREEDY, "audit", speculate=False, background=True)
    while background.num_generated == 0:
        engine.step()
    live = engine.add_request([10, 11, 12], GREEDY)
    outputs = engine.step()
    assert background.finish_reason == "abort" and any(o.seq is background for o in outputs)
    assert live.slot >= 0  # admitted in that same step, to the row it held
    engine.generate([busy, live])
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_background_rows_sit_out_the_steps_that_feed_a_live_prompt(target, monkeypatch):
    engine = speculating(target, 3)
    engine.scheduler.prefill_chunk = 16
    monkeypatch.setattr(engine.scheduler.chunk_sizer, "size", lambda rows, max_chunk: max_chunk)
    background = engine.add_request(REPEATS, GREEDY, "audit", speculate=False, background=True)
    while background.num_generated == 0:
        engine.step()
    long = engine.add_request([3 + i % 90 for i in range(70)], GREEDY)
    held = background.num_generated
    steps = 0
    while long.num_generated == 0:
        outputs = engine.step()
        steps += 1
        # Its prompt in passes of its own (not riding a background row's pass), its first token without it.
        assert background.num_generated == held and all(o.seq is not background for o in outputs)
    assert steps == 1  # with nothing live decoding, the whole prompt in passes of its own and its first token
    engine.step()
    assert background.num_generated > held  # it goes on once the live prompt is in
    engine.generate([long, background])
    assert background.output_ids == plain(target, REPEATS)
    assert long.output_ids == plain(target, long.prompt_ids)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_sequence_without_speculation_drafts_nothing_and_writes_plain_decodings_tokens(target, params):
    engine = speculating(target, 2)
    spec = engine.add_request(REPEATS, params)
    unspec = engine.add_request(REPEATS, params, speculate=False)
    engine.generate([spec, unspec])
    assert spec.stats.num_draft_tokens > 0 and unspec.stats.num_draft_tokens == 0
    assert unspec.output_ids == spec.output_ids == plain(target, REPEATS, params)
