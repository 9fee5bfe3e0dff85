"""Chunked prefill: a long prompt arriving never stops the running streams for more than a chunk, and its
answer is the one it gets alone."""

from __future__ import annotations

import pytest
from conftest import save_tiny

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.scheduler import Prefill, plan_chunks
from speculant.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny(tmp_path_factory.mktemp("sched") / "m", seed=2), dtype="bfloat16")


def seq(n_prompt: int, cached: int = 0) -> Sequence:
    s = Sequence("r", list(range(3, 3 + n_prompt)), GREEDY, 8, None, None)
    s.num_cached = cached
    return s


def test_plan_gives_one_chunk_while_others_decode():
    a, b = Prefill([seq(101)]), Prefill([seq(10)])
    assert plan_chunks([a, b], 32, decoding=True) == [(a, 32)]
    assert plan_chunks([a, b], 32, decoding=False) == [(a, 32), (a, 32), (a, 32), (a, 4), (b, 9)]
    small = Prefill([seq(10)])
    assert plan_chunks([small, a], 32, decoding=True) == [(small, 9), (a, 23)]
    whole = Prefill([seq(10, cached=9)])  # all of it from the prefix cache: one empty chunk shows the proposer
    assert plan_chunks([whole], 32, decoding=True) == [(whole, 0)]
    whole.started = True
    assert whole.done and plan_chunks([whole], 32, decoding=True) == []


def alone(target, prompt: list[int]) -> list[int]:
    engine = Engine(target, max_batch_size=1, max_model_len=256)
    return engine.generate([engine.add_request(prompt, GREEDY)])[0].output_ids


def test_running_streams_go_on_while_a_long_prompt_is_fed(target):
    engine = Engine(target, max_batch_size=4, max_model_len=256)
    engine.prefill_chunk = 16
    running = [engine.add_request([5, 6, 7], GREEDY), engine.add_request([9, 10], GREEDY)]
    engine.step()
    long = engine.add_request([3 + i % 90 for i in range(100)], GREEDY)
    chunks = 0
    while long not in engine.running:
        outputs = engine.step()
        # Every step still gives each running stream its tokens, and feeds one chunk of the new prompt.
        assert {o.seq.request_id for o in outputs if o.new_token_ids} >= {s.request_id for s in running}
        chunks += 1
    assert chunks == -(-99 // 16)
    engine.generate(running + [long])
    assert long.output_ids == alone(target, long.prompt_ids)
    assert [s.output_ids for s in running] == [alone(target, s.prompt_ids) for s in running]


def test_a_group_goes_on_when_its_first_sequence_is_aborted(target):
    """Requests with one prompt (the API's n) share its chunks; the first one leaving hands them on."""
    engine = Engine(target, max_batch_size=4, max_model_len=256)
    engine.prefill_chunk = 8
    busy = engine.add_request([5, 6], GREEDY)
    engine.step()
    prompt = [3 + i % 90 for i in range(40)]
    first, second = engine.add_request(prompt, GREEDY), engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()
    assert first.num_cached == 16 and second not in engine.running
    engine.abort(first.request_id)
    engine.generate([busy, second])
    assert first.finish_reason == "abort"
    assert second.output_ids == alone(target, prompt)
    assert not engine.prefilling and sorted(engine.free_slots) == list(range(4))
