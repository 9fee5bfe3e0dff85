"""Adaptive k: the speed-up model picks k from the cost curve and acceptance, 0 where it loses;
whatever k it picks, greedy output stays identical."""

from __future__ import annotations

import pytest

from speculant.adaptive import MODEL_BUCKET, AdaptiveK, StepRecord, cost_curve_for, expected_tokens_upto
from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers.ngram import NgramProposer
from speculant.speedup import CostCurve


def curve(flat_until_batch: int) -> CostCurve:
    """Memory-bound (a pass over 9 tokens costs 1.1× one token) up to a batch size, then
    compute-bound (cost grows with the tokens of the pass)."""
    rows = {}
    for b in (1, 2, 4, 8, 16, 32):
        if b <= flat_until_batch:
            rows[b] = [1.0 + 0.0125 * (t - 1) for t in range(1, 10)]
        else:
            rows[b] = [float(t) for t in range(1, 10)]
    return CostCurve(context=128, seconds=rows)


def test_memory_bound_high_acceptance_drafts_long():
    policy = AdaptiveK(curve(4), k_max=8, alpha=0.9)
    assert policy.choose(1) == 8
    assert policy.best([0], [8])[1] == pytest.approx((1 - 0.9 ** 9) / 0.1 / 1.1, rel=1e-6)


def test_compute_bound_batch_switches_speculation_off():
    policy = AdaptiveK(curve(4), k_max=8, alpha=0.9)
    assert policy.choose(16) == 0


def test_low_acceptance_shortens_or_stops_drafting():
    policy = AdaptiveK(curve(32), k_max=8, alpha=0.9)
    long_k = policy.choose(1)
    for _ in range(40):  # every draft rejected
        policy.observe(StepRecord([0], [4], [0], draft_s=0.0, batch_size=1))
    assert policy.acceptance()[0] < 0.1
    assert policy.choose(1) < long_k


def test_copy_runs_keep_long_drafts_despite_frequent_misses():
    """n-gram lookup: half the drafts are wrong at once, the others right all the way: per-position
    acceptance sees a_1 = 0.5 and a_2.. near 1, so k stays long."""
    policy = AdaptiveK(curve(32), k_max=8, alpha=0.5)
    for _ in range(40):
        policy.observe(StepRecord([0, 0], [8, 8], [0, 8], draft_s=0.0, batch_size=1))
    a = policy.acceptance()
    assert a[0] == pytest.approx(0.5, abs=0.02) and min(a[1:]) > 0.9
    assert policy.choose(1) == 8
    assert expected_tokens_upto(a)[8] > 4


def test_expensive_draft_lowers_k():
    cheap = AdaptiveK(curve(32), k_max=8, alpha=0.7)
    costly = AdaptiveK(curve(32), k_max=8, alpha=0.7, draft_ratio=0.3)
    assert costly.choose(1) < cheap.choose(1)


def test_off_policy_probes_less_and_less_while_probes_fail():
    policy = AdaptiveK(curve(32), k_max=8, alpha=0.0, probe_every=4)
    chosen = [policy.choose(1) for _ in range(4 + 8 + 16)]
    assert [i for i, k in enumerate(chosen) if k] == [3, 11, 27] and set(chosen) == {0, 2}
    for _ in range(20):  # a probe found acceptance high: speculation is back on, the wait resets
        policy.observe(StepRecord([0], [2], [2], draft_s=0.0, batch_size=1))
    assert policy.choose(1) > 0
    for _ in range(60):
        policy.observe(StepRecord([0], [2], [0], draft_s=0.0, batch_size=1))
    policy.probe_debt = 0.0  # the wait alone here: the probes' budget is the next test's
    assert [policy.choose(1) for _ in range(4)] == [0, 0, 0, 2]


def test_a_new_request_gets_its_own_look_at_the_drafts():
    """A drafter that one request's rejections turned off is probed as soon as the next request starts,
    and that request's own drafts outweigh the old evidence."""
    fresh, stale = (AdaptiveK(curve(32), k_max=8, alpha=0.7, draft_ratio=0.3) for _ in range(2))
    # A draft costs 0.3 of a pass (the curve's C(1) is 1 s).
    for policy in (fresh, stale):
        for _ in range(40):
            policy.observe(StepRecord([MODEL_BUCKET], [4], [0], draft_s=4 * 0.3, batch_size=1))
        assert [policy.choose(1) for _ in range(3)] == [0, 0, 0]
    fresh.new_request()
    assert fresh.choose(1) > 0 and stale.choose(1) == 0  # a probe at once
    for policy in (fresh, stale):
        for _ in range(5):  # the new request's drafts are right
            policy.observe(StepRecord([MODEL_BUCKET], [2], [2], draft_s=2 * 0.3, batch_size=1))
    assert fresh.choose(1) > 0
    assert stale.choose(1) == 0


def test_probes_cost_at_most_their_share_where_wide_passes_are_dear():
    """A routed-experts target: a pass of 3 tokens costs 2 of 1. Probes, at every new request included, stay
    within MAX_PROBE_SHARE of the steps; on a flat curve the next request is still probed at once."""
    from speculant.adaptive import MAX_PROBE_SHARE

    dear = CostCurve(context=128, seconds={1: [1.0 + 0.5 * (t - 1) for t in range(1, 10)]})
    policy = AdaptiveK(dear, k_max=4, alpha=0.0, probe_every=4)
    probes = 0
    for step in range(600):
        if step % 64 == 0:
            policy.new_request()
        probes += policy.choose(1) > 0
    cost = dear.ratio(1, 3) - 1
    assert 1 <= probes <= 600 * MAX_PROBE_SHARE / cost + 1
    cheap = AdaptiveK(curve(32), k_max=4, alpha=0.0, probe_every=4)
    for _ in range(64):
        cheap.choose(1)
    cheap.new_request()
    assert cheap.choose(1) > 0


def test_a_model_that_is_off_is_probed_at_batch_1_only():
    policy = AdaptiveK(curve(32), k_max=8, alpha=0.0, probe_every=4)
    assert not any(policy.choose(4) for _ in range(40))  # a batch: no probe, the wait does not grow
    assert [policy.choose(1) for _ in range(4)] == [0, 0, 0, 2]


def test_adaptive_engine_stays_greedy_identical(tiny_pair, tmp_path):
    target = load_model(tiny_pair[0])
    measured = cost_curve_for(target.model, 4, 5, cache_dir=tmp_path)
    assert cost_curve_for(target.model, 4, 5, cache_dir=tmp_path).seconds == measured.seconds  # cached
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], [9]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = Engine(target, max_batch_size=4, max_model_len=128)
    expected = [s.output_ids for s in plain.generate([plain.add_request(p, params) for p in prompts])]
    for flat in (32, 0):  # speculation on / off by the curve
        engine = Engine(target, NgramProposer(1, 3), 4, max_batch_size=4, max_model_len=128,
                        adaptive=AdaptiveK(curve(flat), k_max=4))
        got = [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])]
        assert got == expected


def test_batched_adaptive_drafts_k_alone_and_lets_the_policy_choose_in_a_batch(tiny_pair):
    """from_batch=2 ("adaptive": "batched"): a sequence alone drafts the fixed k even where the policy would
    switch drafting off (a compute-bound curve) and never measures the curve; a batch drafts what the policy
    plans; output stays greedy."""
    target = load_model(tiny_pair[0])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11], [9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    loads = []

    def load():
        loads.append(1)
        return curve(0)

    def run(batch: list[list[int]], from_batch: int | None):
        adaptive = None if from_batch is None else AdaptiveK(None, k_max=4, alpha=0.9, from_batch=from_batch,
                                                             load_curve=load)
        engine = Engine(target, NgramProposer(1, 3), 4, max_batch_size=4, max_model_len=128, adaptive=adaptive)
        out = [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in batch])]
        return out, engine.stats.num_draft_tokens

    for prompt in prompts:
        fixed, fixed_drafts = run([prompt], None)
        alone, alone_drafts = run([prompt], 2)
        assert alone == fixed and alone_drafts == fixed_drafts > 0 and not loads
        assert run([prompt], 1)[1] < fixed_drafts  # the policy alone cuts them
        loads.clear()
    fixed, fixed_drafts = run(prompts, None)
    batched, batched_drafts = run(prompts, 2)
    assert batched == fixed and batched_drafts < fixed_drafts and loads == [1]


def test_a_draft_model_behind_lookup_stays_greedy_identical_with_batched_adaptive(tiny_pair):
    from speculant.config import SpeculativeConfig
    from speculant.llm import engine_for

    target = load_model(tiny_pair[0])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], [9]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = Engine(target, max_batch_size=3, max_model_len=128)
    expected = [s.output_ids for s in plain.generate([plain.add_request(p, params) for p in prompts])]
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 4,
                                    "lookup_first": True, "draft_p_chain": 1e-4, "adaptive": "batched"})
    engine = engine_for(target, spec, 3, 128)
    assert engine.adaptive.from_batch == 2
    batched = [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])]
    alone = [engine.generate([engine.add_request(p, params)])[0].output_ids for p in prompts]
    assert batched == expected and alone == expected and engine.stats.num_draft_tokens > 0


def test_rare_drafts_stay_on_alone_but_not_in_a_batch():
    """A lookup that finds drafts for 6 rows of 32: alone, a row with a draft verifies it; in the batch
    the 26 others would pay for the widened pass and yield one token each."""
    rows = {b: [1.0 + 0.2 * (t - 1) for t in range(1, 10)] for b in (1, 32)}
    policy = AdaptiveK(CostCurve(context=128, seconds=rows), k_max=4, alpha=0.9)
    assert policy.plan([0], [4]) == [4]
    assert policy.plan([0] * 32, [4] * 6 + [0] * 26) == [0] * 32
    assert policy.plan([0] * 32, [4] * 32) == [4] * 32
    # One row with a long draft widens the pass: the others fill it with what they have.
    wide, short = policy.plan([0, 0], [4, 1])
    assert wide >= 2 and short == 1


def test_no_probes_where_even_perfect_drafts_would_not_pay():
    """Batch 32, two rows with a draft: were both accepted in full the widened pass would still lose,
    so probing them only costs."""
    rows = {b: [1.0 + 0.2 * (t - 1) for t in range(1, 10)] for b in (1, 32)}
    policy = AdaptiveK(CostCurve(context=128, seconds=rows), k_max=4, alpha=0.0, probe_every=4)
    few = [4, 4] + [0] * 30
    assert [max(policy.plan([1] * 32, few)) for _ in range(100)] == [0] * 100
    assert max(max(policy.plan([1] * 32, [4] * 32)) for _ in range(4)) > 0  # all rows drafting: it probes


def test_acceptance_is_kept_per_bucket():
    """n-gram lookup: drafts after a 1-token match keep missing, after a 4-token match they are copied
    runs; the misses of the first must not switch off the second (bucket = match length)."""
    policy = AdaptiveK(curve(32), k_max=4)
    for _ in range(40):
        policy.observe(StepRecord([1, 4], [4, 4], [0, 4], draft_s=0.0, batch_size=1))
    assert policy.acceptance(1)[0] < 0.1 and policy.acceptance(4)[0] > 0.9
    assert policy.plan([1], [4]) == [0]
    assert policy.plan([4], [4]) == [4]


def test_a_slowed_single_token_pass_does_not_make_wide_passes_look_free():
    from speculant.speedup import monotone

    # C(1) caught a stall (9.0): without the fix C(5)/C(1) would read 0.2 and speculation look free.
    measured = [9.0, 1.1, 1.3, 1.2, 1.8]
    assert monotone(measured) == [1.1, 1.1, 1.2, 1.2, 1.8]


def test_widening_cost_measured_in_the_run_scales_the_curves():
    """The curve says a 2-token pass costs 1.3× one token: a first draft accepted 3 times in 10 then
    loses. If this run's own passes show widening at a sixth of that (1.05×) the scale is clamped to
    0.5 (1.15×) and the draft pays; measured costlier (1.6×: clamped to 1.5, 1.45×) it stays off."""
    steep = CostCurve(context=128, seconds={1: [1.0, 1.3, 1.6, 1.9, 2.2]})
    runs = {}
    for wide_seconds in (None, 0.0105, 0.016):
        policy = AdaptiveK(steep, k_max=4, alpha=0.3)
        if wide_seconds is not None:
            for _ in range(10):
                policy.observe_pass(1, 1, 0.010)
                policy.observe_pass(1, 2, wide_seconds)
        runs[wide_seconds] = (policy.calibration(1), policy.plan([0], [4])[0])
    assert runs[None] == (1.0, 0)
    assert runs[0.0105][0] == 0.5 and runs[0.0105][1] > 0
    assert runs[0.016] == (1.5, 0)
    assert policy.calibration(2) == 1.0  # batches keep the curve


def test_without_a_queue_a_batch_drafts_for_the_rows_it_waits_for():
    """With nobody waiting for a slot a batch is done when its last row is: drafts for one row of two
    that are as far from done save no step, so that pass is not widened (it is with a queue, where
    the row's early finish admits the next request); drafts for the row furthest behind are."""
    policy = AdaptiveK(curve(4), k_max=4, alpha=0.9)
    assert policy.plan([0, 0], [4, 0]) == [4, 0]  # requests waiting: every token counts
    assert policy.plan([0, 0], [4, 0], remaining=[40, 40]) == [0, 0]
    assert policy.plan([0, 0], [4, 0], remaining=[40, 10]) == [4, 0]
    assert policy.plan([0, 0], [4, 4], remaining=[40, 40]) == [4, 4]


def test_a_batch_that_drafts_nothing_looks_for_drafts_less_and_less_often():
    """After a batch step whose drafts were all left out, 1, 2, 4 … 8 steps go without a look-up (idle
    for the probes); a step that drafts resets it; batch 1 always looks."""
    policy = AdaptiveK(curve(4), k_max=4, alpha=0.5)
    looked = []
    for _ in range(40):
        looked.append(policy.worth_proposing(16))
        if looked[-1]:
            assert policy.plan([0] * 16, [4] + [0] * 15) == [0] * 16
    assert looked[:12] == [True, False, True, False, False, True, False, False, False, False, True, False]
    assert sum(looked[20:]) <= 3  # every 9th step at most, once the wait is 8
    assert policy.worth_proposing(1)
    memory_bound = AdaptiveK(curve(32), k_max=4, alpha=0.9, skipped=8)
    assert memory_bound.plan([0] * 16, [4] * 16) == [4] * 16 and memory_bound.worth_proposing(16)
    assert memory_bound.skipped == 0
