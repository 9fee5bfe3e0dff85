"""Lookup first, a model's drafts elsewhere: both kinds of draft in one run (often in one step) and
the output stays the target's, greedy and sampled."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_adaptive import curve
from test_distribution import ALPHA, N_SAMPLES, N_TOKENS, SETTINGS, exact_joint, g_test, sampled_joint
from test_eagle import saved_head

from speculant.adaptive import MODEL_BUCKET, AdaptiveK, StepRecord
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.proposers.base import Proposal
from speculant.proposers.draft_model import DraftModelProposer
from speculant.proposers.lookup_first import LookupFirstProposer
from speculant.proposers.ngram import NgramProposer
from speculant.sampling import SamplingBatch

# Seeded requests here are judged as unseeded ones are (conftest.rule_path): the acceptance rule's path.
pytestmark = pytest.mark.usefixtures("rule_path")

# Repeats for the lookup to find, and stretches where it finds nothing.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], list(range(20, 45)) + list(range(20, 30)), [9]]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
BATCH = 400


def count_drafts(engine: Engine) -> dict[str, int]:
    """Spy on the engine's proposals: steps with lookup drafts, with model drafts, with both."""
    seen = {"lookup": 0, "model": 0, "both": 0}
    original = engine.propose

    def spy(batch, sb):
        out = original(batch, sb)
        kinds = {key == MODEL_BUCKET for key, n in zip(out.bucket_list(), out.n_draft.tolist()) if n}
        seen["lookup"] += False in kinds
        seen["model"] += True in kinds
        seen["both"] += len(kinds) == 2
        return out

    engine.propose = spy
    return seen


def lookup_first_engine(target, spec: dict, batch: int, adaptive: AdaptiveK | None = None) -> Engine:
    cfg = SpeculativeConfig.parse({**spec, "lookup_first": True})
    proposer = build_proposer(cfg, target, batch, 128 + cfg.num_speculative_tokens + 1)
    assert isinstance(proposer, LookupFirstProposer)
    return Engine(target, proposer, cfg.num_speculative_tokens, max_batch_size=batch, max_model_len=128,
                  adaptive=adaptive)


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_batch_size=4, max_model_len=128)
    return [s.output_ids for s in engine.generate([engine.add_request(p, GREEDY) for p in PROMPTS])]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_greedy_output_is_plain_greedy(target, tiny_pair, tmp_path, plain, method, k, adaptive):
    model = str(tiny_pair[1]) if method == "draft_model" else str(saved_head(target, tmp_path))
    # Three slots for four requests: one joins mid-way. Adaptive on a flat curve: speculation pays.
    policy = AdaptiveK(curve(32), k_max=k) if adaptive else None
    engine = lookup_first_engine(target, {"method": method, "model": model, "num_speculative_tokens": k}, 3,
                                 policy)
    seen = count_drafts(engine)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, GREEDY) for p in PROMPTS])]
    assert got == plain
    assert seen["lookup"] and seen["model"], seen


@pytest.fixture(scope="module")
def small(small_vocab_pair):
    return load_model(small_vocab_pair[0]), load_model(small_vocab_pair[1])


class LookupRowsReportUniformQ(LookupFirstProposer):
    """Reports the lookup's rows as drawn from a uniform q: they were not (the rule then accepts their drafts
    with probability 8·p instead of p)."""

    def complete(self, seqs, found, ks, sb):
        out = super().complete(seqs, found, ks, sb)
        if out.q is None:
            return out
        lookup_rows = torch.tensor([key != MODEL_BUCKET for key in out.bucket_list()])
        q = torch.where(lookup_rows[:, None, None], torch.full_like(out.q, 1 / out.q.shape[-1]), out.q)
        return Proposal(out.tokens, out.n_draft, q, out.buckets)  # by_rule None: every row by the rule


def small_engine(small, proposer_cls=LookupFirstProposer) -> Engine:
    target, draft = small
    proposer = proposer_cls(NgramProposer(1, 3), DraftModelProposer(draft, target.config.vocab_size, BATCH, 64))
    return Engine(target, proposer, 2, max_batch_size=BATCH, max_model_len=32)


@pytest.mark.parametrize("setting", ["t1", "t0.7_topk"])
def test_sampling_matches_target(small, setting):
    """Vocabulary of 8: lookup finds matches in some rows and not in others of the same step; the lookup's
    rows are verified by coupling, the model's by the acceptance rule with their q."""
    engine = small_engine(small)
    seen = count_drafts(engine)
    params = SETTINGS[setting]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(small[0].model, params, N_TOKENS))
    print(f"draft_model+lookup {setting}: G-test p = {p:.4f}, steps {seen}")
    assert seen["both"] > 0
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA


def test_mutant_is_caught(small):
    engine = small_engine(small, LookupRowsReportUniformQ)
    params = SETTINGS["t1"]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(small[0].model, params, N_TOKENS))
    assert p < ALPHA


def test_greedy_and_sampled_rows_in_one_step(small):
    """A batch where greedy rows (q = None for them) and sampled rows draft by lookup and by the
    model at once: the greedy rows still equal plain greedy."""
    target = small[0]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [1, 5, 3, 6, 1, 5]
    plain = Engine(target, max_batch_size=1, max_model_len=32)
    expected = plain.generate([plain.add_request(prompt, greedy)])[0].output_ids
    engine = small_engine(small)
    seen = count_drafts(engine)
    sampled = [engine.add_request(prompt, replace(SETTINGS["t1"], seed=i, max_tokens=12, ignore_eos=True))
               for i in range(20)]
    rows = [engine.add_request(prompt, greedy) for _ in range(20)]
    engine.generate(sampled + rows)
    assert all(s.output_ids == expected for s in rows)
    assert seen["both"] > 0


def test_only_model_drafts_set_the_draft_cost():
    policy = AdaptiveK(curve(32), k_max=4)
    cost = policy.curve.cost(2, 1)
    policy.observe(StepRecord([3, 4], [4, 4], [4, 1], draft_s=0.001 * cost, batch_size=2))  # lookup rows only: free
    assert policy.draft_ratio == 0.0
    policy.observe(StepRecord([3, MODEL_BUCKET], [4, 2], [4, 1], draft_s=0.9 * cost, batch_size=2))
    assert policy.draft_ratio == 0.0  # the model first read what it missed while lookup drafted
    policy.observe(StepRecord([3, MODEL_BUCKET], [4, 2], [4, 1], draft_s=0.4 * cost, batch_size=2))
    assert policy.draft_ratio == pytest.approx(0.2)  # 0.4 over the model's 2 drafts
    policy.observe(StepRecord([3, MODEL_BUCKET], [0, 0], [0, 0], draft_s=0.0, batch_size=2))  # a plain step
    policy.observe(StepRecord([3, MODEL_BUCKET], [4, 2], [4, 1], draft_s=0.9 * cost, batch_size=2))
    assert policy.draft_ratio == pytest.approx(0.2)


def test_a_joining_rows_first_draft_does_not_set_the_draft_cost():
    """A row's first draft reads the end of its prompt: counted as drafting, one such step made a real pair's
    draft look 1.5x dearer than it was and turned it off for the rest of the run."""
    for join in ("new_request", "joined"):
        policy = AdaptiveK(curve(32), k_max=4)
        cost = policy.curve.cost(1, 1)
        for _ in range(2):
            policy.observe(StepRecord([MODEL_BUCKET], [2], [1], draft_s=0.4 * cost, batch_size=1))
        assert policy.draft_ratio == pytest.approx(0.2) and len(policy.draft_costs) == 1
        getattr(policy, join)()
        policy.observe(StepRecord([MODEL_BUCKET], [2], [1], draft_s=3.0 * cost, batch_size=1))  # the prompt's end
        assert list(policy.draft_costs) == pytest.approx([0.2])
        policy.observe(StepRecord([MODEL_BUCKET], [2], [1], draft_s=0.5 * cost, batch_size=1))
        assert policy.draft_ratio == pytest.approx(0.225)


def test_one_slow_step_does_not_turn_a_paying_drafter_off():
    """Another process's burst can make one drafting step several times slower. The draft's cost is the median
    of the last steady steps, so a drafter that paid still drafts (a running mean took it off: a drafter that is
    off measures nothing more)."""
    policy = AdaptiveK(curve(32), k_max=4, alpha=0.8)
    cost = policy.curve.cost(1, 1)
    for _ in range(6):
        policy.observe(StepRecord([MODEL_BUCKET], [4], [3], draft_s=4 * 0.2 * cost, batch_size=1))
    assert policy.choose(1) > 0
    policy.observe(StepRecord([MODEL_BUCKET], [4], [3], draft_s=4 * 5.0 * cost, batch_size=1))  # the burst
    assert policy.draft_ratio == pytest.approx(0.2)
    assert policy.choose(1) > 0
    for _ in range(5):  # the draft did get dearer: the estimate follows within half the window
        policy.observe(StepRecord([MODEL_BUCKET], [4], [3], draft_s=4 * 5.0 * cost, batch_size=1))
    assert policy.draft_ratio == pytest.approx(5.0) and policy.choose(1) == 0


def test_lookup_first_needs_a_model():
    with pytest.raises(Exception, match="lookup_first .* needs method draft_model or eagle"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "lookup_first": True})
    with pytest.raises(Exception, match="lookup_first must be true or false"):
        SpeculativeConfig.parse({"method": "eagle", "model": "x", "num_speculative_tokens": 2, "lookup_first": "yes"})
    cfg = SpeculativeConfig.parse({"method": "eagle", "model": "x", "num_speculative_tokens": 2, "lookup_first": True})
    assert cfg.proposer == "eagle+lookup"


def test_sampled_lookup_rows_are_coupled(small):
    """A lookup row is verified by coupling (by_rule False), the model's row by the rule with its q; the
    draft model ran for the other row only."""
    engine = small_engine(small)
    seq = engine.add_request([1, 5, 3, 6, 1, 5], SETTINGS["t1"])
    other = engine.add_request([7, 4], SETTINGS["t1"])
    engine.schedule()
    sb = SamplingBatch.build([seq.params, other.params], [seq.key, other.key], engine.device)
    out = engine.proposer.propose([seq, other], [2, 2], sb)
    assert out.bucket_list()[0] != MODEL_BUCKET and out.bucket_list()[1] == MODEL_BUCKET
    assert int(out.n_draft[0]) and out.by_rule == [False, True]
    assert out.q[1].sum(-1).allclose(torch.ones(2))
    fed = engine.proposer.model.fed
    assert fed[seq.request_id] == 0  # the prompt's last chunk waits for the model's first draft, none yet
    assert fed[other.request_id] == len(other.tokens) + 1  # its last token, then its first draft


def test_each_row_keeps_the_drafter_that_promises_more():
    """Long matches (all 4 drafts kept) beat a model whose first draft is always kept, its second half
    the time; 1-token matches (first draft kept a third of the time) do not. Where the model's drafts
    cost more than they yield, every match keeps its drafts."""
    policy = AdaptiveK(curve(32), k_max=4, draft_ratio=0.05)
    for _ in range(30):
        policy.observe(StepRecord([4, 1, MODEL_BUCKET], [4, 4, 2], [4, 0, 1], draft_s=0.0, batch_size=3))
        policy.observe(StepRecord([1, MODEL_BUCKET], [4, 2], [1, 2], draft_s=0.0, batch_size=2))
        policy.observe(StepRecord([1], [4], [0], draft_s=0.0, batch_size=1))
    assert policy.keep_lookup([4, 1, 2, MODEL_BUCKET], [4, 3, 0, 0]) == [4, 0, 0, 0]
    policy.draft_ratio = 2.0  # a draft costs two passes: the model never pays
    assert policy.keep_lookup([4, 1], [4, 3]) == [4, 3]


def test_a_row_far_behind_catches_up_apart(tiny_pair, target):
    """A row whose draft lags by many tokens (an answer prompt lookup drafted) is fed its lag in a pass of
    its own: the batch's catch-up pass stays as narrow as its rows usually are, and every row's draft state
    is what it is when fed alone."""
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 4,
                                   "lookup_first": False})

    def caught_up(prompts: list[list[int]], lag: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        proposer = build_proposer(cfg, target, 4, 128)
        assert isinstance(proposer, DraftModelProposer)
        engine = Engine(target)
        seqs = [engine.add_request(p, GREEDY) for p in prompts]
        for s, behind in zip(seqs, lag):
            proposer.add(s)
            proposer._feed([s], [s.tokens[:len(s.tokens) - behind]])
        shapes = []
        forward = proposer.model.forward
        proposer.model.forward = lambda tokens, *a, **k: shapes.append(tuple(tokens.shape)) or forward(tokens, *a, **k)
        return proposer.catch_up(seqs), shapes

    prompts = [list(range(3, 60)), [5, 6, 7, 8], [9, 10, 11]]
    hidden, shapes = caught_up(prompts, [50, 2, 1])
    assert shapes == [(1, 48), (3, 2)]
    alone = torch.cat([caught_up([p], [n])[0] for p, n in zip(prompts, [50, 2, 1])])
    assert torch.equal(hidden, alone)
