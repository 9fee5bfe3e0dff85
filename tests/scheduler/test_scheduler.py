"""Chunked prefill: a long prompt arriving never stops the running streams for more than a chunk, and its
answer is the one it gets alone."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.scheduler.chunks import ChunkSizer, Prefill, added_tiles, plan_chunks, rider_positions
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
    engine.scheduler.prefill_chunk = 16
    running = [engine.add_request([5, 6, 7], GREEDY), engine.add_request([9, 10], GREEDY)]
    engine.step()
    long = engine.add_request([3 + i % 90 for i in range(100)], GREEDY)
    steps = 0
    while long not in engine.scheduler.running:
        fed = long.num_cached
        outputs = engine.step()
        # Every step still gives each running stream its tokens, and feeds one chunk of the new prompt.
        assert {o.seq.request_id for o in outputs if o.new_token_ids} >= {s.request_id for s in running}
        assert 0 < long.num_cached - fed <= 16 or long in engine.scheduler.running
        steps += 1
    assert steps >= -(-99 // 16)
    engine.generate(running + [long])
    assert long.output_ids == alone(target, long.prompt_ids)
    assert [s.output_ids for s in running] == [alone(target, s.prompt_ids) for s in running]


def test_a_group_goes_on_when_its_first_sequence_is_aborted(target, monkeypatch):
    """Requests with one prompt (the API's n) share its chunks; the first one leaving hands them on."""
    engine = Engine(target, max_batch_size=4, max_model_len=256)
    engine.scheduler.prefill_chunk = 8
    # Chunks of 8 whatever the passes' timings (beside decoding the sizer would fit them to a step's cost).
    monkeypatch.setattr(engine.scheduler.chunk_sizer, "size", lambda rows, max_chunk: max_chunk)
    busy = engine.add_request([5, 6], GREEDY)
    engine.step()
    prompt = [3 + i % 90 for i in range(40)]
    first, second = engine.add_request(prompt, GREEDY), engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()
    assert first.num_cached == 16 and second not in engine.scheduler.running
    engine.abort(first.request_id)
    engine.generate([busy, second])
    assert first.finish_reason == "abort"
    assert second.output_ids == alone(target, prompt)
    assert not engine.scheduler.prefilling and sorted(engine.scheduler.free_slots) == list(range(4))


def test_a_chunk_beside_decoding_costs_about_one_and_a_half_steps():
    """Padded passes: a chunk adds its row and the running rows' padding (rider_positions)."""
    sizer = ChunkSizer()
    sizer.observe_step(0.040, width=5)
    assert sizer.size(rows=3, max_chunk=512) == 5  # nothing timed yet: a row as wide as the batch's
    # Steps that carried chunks: a fixed 10 ms (the chunk's draft pass, say) and 2 ms a position added.
    for n in (5, 8, 12, 5, 16):
        sizer.observe_step(0.040 + 0.010 + 0.002 * rider_positions(n, 3, 5), n, rows=3, width=5)
    assert sizer.fit() == pytest.approx((0.010, 0.002))
    # 50 ms to spend (1.5 steps less the fixed part): a chunk of 10 adds 10 + 3 × 5 positions, 50 ms; 11 adds 58.
    assert sizer.size(rows=3, max_chunk=512) == 10
    assert rider_positions(11, 3, 5) * 0.002 + 0.010 > 1.5 * 0.040
    assert sizer.size(rows=3, max_chunk=6) == 6
    assert sizer.size(rows=0, max_chunk=512) == 25  # alone, the chunk's own row is all it adds
    sizer.step_s = 0.005  # steps far cheaper than any chunk: the smallest chunk still moves the prompt on
    assert sizer.size(rows=3, max_chunk=512) == 4


def test_rider_positions_count_the_padding_a_chunk_causes():
    assert rider_positions(3, 4, 5) == 5  # narrower than the pass: its own row, padded
    assert rider_positions(9, 4, 5) == 9 + 4 * 4


def test_on_packed_passes_a_chunk_fills_tiles():
    """Packed passes cost by the tile of rows the native matmuls take at once: a chunk fills the running rows'
    last tile, and takes whole tiles more where the step's budget allows."""
    assert [added_tiles(n, 3, 4) for n in (1, 2, 5, 6, 9)] == [0, 1, 1, 2, 2]
    sizer = ChunkSizer(tile=4)
    sizer.observe_step(0.060, rows=3, positions=3)
    assert sizer.size(rows=3, max_chunk=512) == 1  # nothing timed yet: the last tile's free row
    # 10 ms a step whatever the chunk, and 30 ms a tile added: 90 ms to spend buys 2 tiles.
    for n in (1, 5, 9, 1, 5):
        sizer.observe_step(0.060 + 0.010 + 0.030 * added_tiles(n, 3, 4), n, rows=3, positions=3)
    assert sizer.fit() == pytest.approx((0.010, 0.030))
    assert sizer.size(rows=3, max_chunk=512) == 9
    sizer.observe_step(0.060, rows=3, positions=8)  # the rows fill two tiles: the chunk starts a third
    assert sizer.size(rows=3, max_chunk=512) == 8
    assert sizer.size(rows=3, max_chunk=5) == 5


def test_a_packed_chunk_that_never_added_a_tile_prices_one_as_a_steps_tiles():
    sizer = ChunkSizer(tile=4)
    for _ in range(3):
        sizer.observe_step(0.060, rows=3, positions=3)
        sizer.observe_step(0.070, 1, rows=3, positions=3)
    # 10 ms a chunk of one row; a tile taken as the step's one tile, 60 ms: 80 ms buys one.
    assert sizer.fit() == pytest.approx((0.010, 0.060))
    assert sizer.size(rows=3, max_chunk=512) == 5
    # That chunk's tile cost 100 ms: learned, and remembered once chunks of one row fill the window again.
    sizer.observe_step(0.060 + 0.010 + 0.100, 5, rows=3, positions=3)
    assert sizer.fit()[1] > 0.060
    for _ in range(40):
        sizer.observe_step(0.070, 1, rows=3, positions=3)
    assert sizer.fit() == pytest.approx((0.010, sizer.learned)) and sizer.learned > 0.060
    assert sizer.size(rows=3, max_chunk=512) == 1


def test_without_chunks_a_prompt_arriving_is_fed_whole_in_one_step(target):
    """--prefill-chunk 0, what the engine did before chunks (kept for comparison): the streams wait once."""
    engine = Engine(target, max_batch_size=4, max_model_len=256)
    engine.scheduler.prefill_chunk = 0
    running = engine.add_request([5, 6, 7], GREEDY)
    engine.step()
    long = engine.add_request([3 + i % 90 for i in range(100)], GREEDY)
    engine.step()
    assert long in engine.scheduler.running and long.num_cached >= 99 and running.output_ids
    engine.generate([running, long])
    assert long.output_ids == alone(target, long.prompt_ids)


def test_the_first_token_does_not_wait_for_the_draft_model(tiny_pair):
    """The prompt's last chunk goes through the target alone and the first step drafts nothing: a draft model
    catches up on the prompt at its first draft, after the first token. The answer is plain decoding's."""
    from speculant.config import SpeculativeConfig
    from speculant.proposers import build_proposer

    target = load_model(tiny_pair[0], dtype="float32")
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 4})
    engine = Engine(target, build_proposer(cfg, target, 2, 256 + 5), 4, max_batch_size=2, max_model_len=256)
    prompt = [3 + i % 90 for i in range(30)]
    seq = engine.add_request(prompt, GREEDY)
    engine.step()
    assert len(seq.output_ids) == 1 and engine.stats.num_draft_tokens == 0
    assert engine.proposer.fed[seq.request_id] == 0
    engine.step()
    assert engine.stats.num_draft_tokens > 0 and engine.proposer.fed[seq.request_id] >= len(prompt)
    engine.generate([seq])
    assert seq.output_ids == alone(target, prompt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_alone_feeds_its_last_chunk_in_the_pass_of_its_first_token(tiny_pair, dtype):
    """With nothing decoding, the prompt's last chunk goes with its first decode step: one pass less before the
    first token, the same keys and values in the cache, the same answer as with the chunk in a pass apart."""
    target = load_model(tiny_pair[0], dtype=dtype)
    prompt = [3 + (5 * i) % 90 for i in range(40)]
    answers, keys, apart = [], [], []
    for tail in (True, False):
        engine = Engine(target, max_batch_size=2, max_model_len=256)
        engine.scheduler.prefill_chunk, engine.scheduler.last_chunk_decodes = 16, tail
        fed = []
        prefill = engine.prefill_apart
        engine.prefill_apart = lambda group, n, fed=fed, prefill=prefill: (fed.append(n), prefill(group, n))
        seq = engine.add_request(prompt, GREEDY)
        engine.step()
        assert len(seq.output_ids) == 1
        keys.append([t[seq.slot, :, :len(prompt)].clone() for t in (*engine.cache.k, *engine.cache.v)])
        apart.append(fed)
        answers.append(engine.generate([seq])[0].output_ids)
    assert apart == [[16, 16], [16, 16, 7]]
    assert answers[0] == answers[1]
    assert all(torch.equal(a, b) for a, b in zip(*keys))


def rides(engine: Engine) -> list[int]:
    """Spy: the chunk sizes fed in passes of their own while other sequences decode (none should be)."""
    apart = []
    prefill = engine.prefill_apart

    def spy(group, n):
        if engine.scheduler.running and n:
            apart.append(n)
        prefill(group, n)

    engine.prefill_apart = spy
    return apart


def feed_long_prompt_beside_streams(engine: Engine) -> tuple[list[Sequence], int]:
    """Two streams decode, a 100-token prompt arrives → (all three, done; the steps its prompt took)."""
    running = [engine.add_request([5, 6, 7], GREEDY), engine.add_request([9, 10, 11, 12], GREEDY)]
    engine.step()
    long = engine.add_request([3 + (7 * i) % 90 for i in range(100)], GREEDY)
    steps = 0
    while long not in engine.scheduler.running:
        engine.step()
        steps += 1
    engine.generate(running + [long])
    return running + [long], steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_ride_in_the_draft_models_verify_pass(tiny_pair, dtype):
    """Beside decoding a prompt's chunks are rows of the running batch's verify pass, never passes of their
    own, and every sequence, the new one included, writes what it writes alone."""
    from speculant.config import SpeculativeConfig
    from speculant.proposers import build_proposer

    target = load_model(tiny_pair[0], dtype=dtype)
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 4})
    engine = Engine(target, build_proposer(cfg, target, 4, 256 + 5), 4, max_batch_size=4, max_model_len=256)
    engine.scheduler.prefill_chunk = 16
    apart = rides(engine)
    seqs, steps = feed_long_prompt_beside_streams(engine)
    assert apart == [] and steps >= -(-99 // 16)
    plain = load_model(tiny_pair[0], dtype=dtype)
    assert [s.output_ids for s in seqs] == [alone(plain, s.prompt_ids) for s in seqs]


def test_a_shifted_chunk_is_caught(target, monkeypatch):
    """Mutant: a chunk read one token late (a stale or shifted prefix) must change some answer."""
    monkeypatch.setattr(Prefill, "next_chunk", lambda self, n: self.lead.tokens[self.lead.num_cached + 1:
                                                                                self.lead.num_cached + 1 + n])
    engine = Engine(target, max_batch_size=4, max_model_len=256)
    engine.scheduler.prefill_chunk = 16
    seqs, _ = feed_long_prompt_beside_streams(engine)
    monkeypatch.undo()
    assert [s.output_ids for s in seqs] != [alone(target, s.prompt_ids) for s in seqs]


def test_chunks_that_cost_no_measurable_time_leave_the_sizer_at_its_first_rule():
    """A step that carried a chunk yet ran faster than the recent steps alone (noise) gives no cost to fit."""
    sizer = ChunkSizer()
    sizer.observe_step(0.006, width=5)
    sizer.observe_step(0.005, 5, rows=1, width=5)
    assert sizer.fit() is None and sizer.size(rows=1, max_chunk=512) == 5
