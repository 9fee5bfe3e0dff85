"""A draft model's trees (proposers/draft_model_tree.py).

Greedy output is plain greedy output, alone and in a batch; sampled output follows the target's distribution
(G-test at test_distribution.ALPHA, fixed seeds) and a seeded request writes plain decoding's tokens; the draft's
cache holds the sequence's own tokens only; each growth pass gives a node the distribution its branch gets decoded
alone; a node below p_chain is not grown; the tree's size follows the target's cost curve, and its growth stops where
another draft pass cannot pay; batches draft chains.
Each rule has a mutant here that its test catches.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import save_tiny, transformers
from mutants import patch_coupling
from safetensors.torch import load_file, save_file
from test_distribution import ALPHA, BATCH, N_SAMPLES, N_TOKENS, SETTINGS, exact_joint, g_test, sampled_joint
from test_tree import count_sibling_paths

from speculant import adaptive, llm
from speculant.adaptive import AdaptiveK
from speculant.arguments import speculative_config_from_args
from speculant.cli import build_parser
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.llm import engine_for
from speculant.models.loader import load_model
from speculant.proposers.draft_model_tree import DraftModelTreeProposer, TreeSize
from speculant.proposers.draft_tree import DraftTree
from speculant.proposers.lookup_first import LookupFirstProposer
from speculant.speedup import CostCurve

# The noisy draft is as large as the target: build_proposer warns that it cannot pay, which is not the point here.
pytestmark = pytest.mark.filterwarnings("ignore:the draft model")

PROMPTS = [[1, 5, 9, 14], [1, 33, 2, 7, 7, 7, 7, 40, 41], [1, 60], [3, 4, 5, 3, 4, 5, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def measured_curve():
    """A cost curve as if measured (C(T)/C(1) = 1 + 0.05 (T − 1) at every batch size): measuring the tiny target's
    takes a minute of a shared machine for every k and width, and adds nothing here."""
    curve = CostCurve(128, {b: [0.01 * b * (1 + 0.05 * t) for t in range(40)] for b in (1, 2, 4, 8)})
    with pytest.MonkeyPatch.context() as mp:
        for module in (adaptive, llm):
            mp.setattr(module, "cost_curve_for", lambda *args, **kwargs: curve)
        yield


@pytest.fixture(scope="module")
def noisy_draft(tiny_pair, tmp_path_factory) -> Path:
    """The target's weights with noise: a draft that agrees with the target often, not always (tiny_pair's own
    draft almost never does, and no tree would keep a second candidate)."""
    folder = tmp_path_factory.mktemp("noisy") / "draft"
    shutil.copytree(tiny_pair[0], folder)
    state = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    state = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
             for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_batch_size=4, max_model_len=64)
    return [s.output_ids for s in engine.generate([engine.add_request(p, GREEDY) for p in PROMPTS])]


def tree_engine(target, draft: Path, k: int, width: int, batch: int, trees_in_batches: bool = True,
                curve: bool = True, **extra) -> tuple[Engine, DraftModelTreeProposer]:
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                                    "tree_width": width, **extra})
    engine = engine_for(target, spec, batch, 64)
    proposer = engine.proposer.model if isinstance(engine.proposer, LookupFirstProposer) else engine.proposer
    assert engine.proposer.name == "draft_model" + "+lookup" * spec.lookup_first + "+tree"  # as logs name it
    if trees_in_batches:
        proposer.chain_from_batch = batch + 1
    if not curve:
        proposer.size.curve = None
    return engine, proposer


@pytest.mark.parametrize("extra", [{}, {"lookup_first": True}, {"adaptive": True}, {"draft_p_chain": 0.011}])
@pytest.mark.parametrize("k, width", [(1, 3), (3, 2), (4, 4)])
def test_greedy_tree_output_is_plain_greedy_in_a_batch(target, noisy_draft, plain, k, width, extra):
    # Three slots for four requests: one joins mid-way.
    engine, _ = tree_engine(target, noisy_draft, k, width, 3, **extra)
    siblings = count_sibling_paths(engine)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, GREEDY) for p in PROMPTS])]
    assert got == plain
    if not extra.get("adaptive"):  # adaptive k may leave a draft as large as its target off
        assert engine.stats.num_accepted_tokens > 0
    if not extra:  # lookup and p_chain take steps from the tree
        assert siblings[0] > 0, siblings  # a kept branch went through another first candidate


@pytest.mark.parametrize("k, width", [(2, 3), (4, 2)])
def test_greedy_tree_output_is_plain_greedy_alone(target, noisy_draft, plain, k, width):
    engine, _ = tree_engine(target, noisy_draft, k, width, 1, trees_in_batches=False)
    siblings = count_sibling_paths(engine)
    got = [engine.generate([engine.add_request(p, GREEDY)])[0].output_ids for p in PROMPTS]
    assert got == plain
    assert siblings[0] > 0, siblings


def test_seeded_sampled_tree_writes_the_plain_tokens(target, noisy_draft):
    """Coupling: with a seed, a sampled row's output is plain sampled output, token for token, beside other rows."""
    params = [SamplingParams(temperature=0.3, seed=seed, max_tokens=24, ignore_eos=True) for seed in range(4)]
    alone = Engine(target, max_batch_size=1, max_model_len=64)
    plain = [alone.generate([alone.add_request(p, sp)])[0].output_ids for p, sp in zip(PROMPTS, params)]
    engine, _ = tree_engine(target, noisy_draft, 3, 3, 4, curve=False)
    siblings = count_sibling_paths(engine)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)])]
    assert got == plain
    assert engine.stats.num_accepted_tokens > 0 and siblings[0] > 0


# -- the sampled distribution ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(small_vocab_pair):
    return load_model(small_vocab_pair[0]), load_model(small_vocab_pair[1])


def small_tree_engine(small) -> tuple[Engine, list[int]]:
    target, draft = small
    proposer = DraftModelTreeProposer(draft, 8, BATCH, 64, tree_width=3, max_depth=2, chain_from_batch=BATCH + 1)
    engine = Engine(target, proposer, 2, max_batch_size=BATCH, max_model_len=32)
    return engine, count_sibling_paths(engine)


@pytest.mark.parametrize("setting", ["t1", "t0.7_topk"])
def test_sampled_tree_matches_target(small, setting):
    engine, siblings = small_tree_engine(small)
    params = SETTINGS[setting]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(small[0].model, params, N_TOKENS))
    print(f"draft model tree {setting}: G-test p = {p:.4f}, {siblings[0]} sibling branches kept")
    assert siblings[0] > 0
    assert p > ALPHA


def test_candidates_tested_against_draws_of_their_own_are_caught(small, monkeypatch):
    """The mutant: a node's candidates each compared with a draw of its own, where coupling compares them all with
    the one token the target draws there."""
    patch_coupling("each_candidate_its_own_draw", monkeypatch)
    engine, _ = small_tree_engine(small)
    params = SETTINGS["t1"]
    assert g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(small[0].model, params, N_TOKENS)) < ALPHA


# -- the draft's cache ------------------------------------------------------------------------------------------


class KeepsTheTreesEntries(DraftModelTreeProposer):
    """The mutant: the last growth pass's entries stay in the draft's cache, counted as fed like a chain's drafts
    (the verifier then keeps those up to the sequence's length, whatever branch it took)."""

    def forget_branches(self, seqs, slots, real):
        for s, length in zip(seqs, self.cache.lengths[slots].tolist()):
            self.fed[s.request_id] = length


def draft_cache_mismatches(target, draft: Path, proposer_cls) -> tuple[int, int]:
    """Greedy trees in a batch; after each step's commit, each row's draft cache against a fresh run of the draft
    over the tokens it says it holds → (rows that differ, rows checked)."""
    engine, proposer = tree_engine(target, draft, 3, 3, 4, curve=False)
    proposer.__class__ = proposer_cls
    model = proposer.model
    counts = Counter()
    commit = proposer.commit

    def checked(seqs, hidden):
        commit(seqs, hidden)
        for s in seqs:
            slot, fed = proposer.slot[s.request_id], proposer.fed[s.request_id]
            with torch.no_grad():
                fresh = model.new_cache(1, 64)
                model(torch.tensor([s.tokens[:fed]]), fresh, torch.tensor([0]))
            same = int(proposer.cache.lengths[slot]) == fed and all(
                torch.allclose(mine[:, slot, :, :fed], theirs[:, 0, :, :fed], rtol=1e-5, atol=1e-5)
                for mine, theirs in ((proposer.cache.k, fresh.k), (proposer.cache.v, fresh.v)))
            counts["checked"] += 1
            counts["differ"] += not same

    proposer.commit = checked
    engine.generate([engine.add_request(p, GREEDY) for p in PROMPTS])
    return counts["differ"], counts["checked"]


def test_draft_cache_holds_the_sequences_own_tokens(target, noisy_draft):
    differ, checked = draft_cache_mismatches(target, noisy_draft, DraftModelTreeProposer)
    assert checked > 20 and differ == 0


def test_trees_entries_kept_in_the_draft_cache_are_caught(target, noisy_draft):
    differ, checked = draft_cache_mismatches(target, noisy_draft, KeepsTheTreesEntries)
    assert differ > checked // 4, (differ, checked)


# -- growth -----------------------------------------------------------------------------------------------------


class ChainMasked:
    """The mutant: the draft model's passes run without the tree's mask (each node sees every node before it in
    the pass, its siblings' branches too)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens, cache, slots, n_new=None, parents=None):
        return self.model(tokens, cache, slots, n_new)

    def __getattr__(self, name):
        return getattr(self.model, name)


def reference_tree(proposer: DraftModelTreeProposer, tokens: list[int], k: int) -> tuple[list[int], list[int]]:
    """The tree the draft should grow, each node's children from its branch decoded alone after `tokens` (a fresh
    pass over the whole sequence), under the same rules: DraftTree's frontier, p_chain."""
    model, width = proposer.model, proposer.tree_width
    tree = DraftTree(k + width - 1, k)

    def grow(node: int) -> None:
        branch = []
        while node >= 0:
            branch.insert(0, tree.tokens[node])
            node = tree.parents[node]
        with torch.no_grad():
            cache = model.new_cache(1, 128)
            hidden = model(torch.tensor([tokens + branch]), cache, torch.tensor([0]))[:, -1:]
        top = torch.log_softmax(proposer._logits(hidden).float()[0, 0], dim=-1).topk(width)
        return top

    top = grow(-1)
    tree.add_children(-1, top.indices.tolist(), top.values.tolist())
    while nodes := proposer.to_grow(tree):
        for n in nodes:
            top = grow(n)
            tree.add_children(n, top.indices.tolist(), top.values.tolist())
    return tree.best()


def growth_mismatches(target, draft: Path, wrap=None) -> tuple[int, int]:
    """Greedy trees in a batch, each compared with reference_tree → (trees that differ, trees with a node below
    depth 1)."""
    engine, proposer = tree_engine(target, draft, 3, 3, 2, curve=False)
    if wrap is not None:
        proposer.model = wrap(proposer.model)
    counts = Counter()
    draft_trees = proposer.draft_trees

    def checked(seqs, ks, batch_size):
        proposal = draft_trees(seqs, ks, batch_size)
        for b, (s, k) in enumerate(zip(seqs, ks)):
            n = int(proposal.n_draft[b])
            got = proposal.tokens[b, :n].tolist(), proposal.parents[b][:n]
            counts["deep"] += any(p >= 0 for p in got[1])
            counts["differ"] += got != reference_tree(proposer, s.tokens, k)
        return proposal

    proposer.draft_trees = checked
    engine.generate([engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                     for p in PROMPTS[:2]])
    return counts["differ"], counts["deep"]


def test_growth_passes_give_each_branch_its_own_distribution(target, noisy_draft):
    differ, deep = growth_mismatches(target, noisy_draft)
    assert deep > 4 and differ == 0


def test_growth_passes_without_the_tree_mask_are_caught(target, noisy_draft):
    differ, deep = growth_mismatches(target, noisy_draft, ChainMasked)
    assert differ > 0, (differ, deep)  # on a tiny random model a node's neighbours change its likeliest few rarely


def grown_below_p_chain(cls) -> list[int]:
    """The nodes a proposer of class `cls` grows, p_chain 0.5, of a tree whose first drafts the draft gives 0.6 and
    0.3, and the first one's children 0.9 (0.54 in all) and 0.1 (0.06)."""
    proposer = cls.__new__(cls)
    proposer.tree_width, proposer.p_chain = 2, 0.5
    tree = DraftTree(budget=8, max_depth=4)
    tree.add_children(-1, [10, 11], [math.log(0.6), math.log(0.3)])
    first = proposer.to_grow(tree)
    tree.add_children(0, [20, 21], [math.log(0.9), math.log(0.1)])
    tree.add_children(1, [30, 31], [math.log(0.5), math.log(0.5)])
    return first + proposer.to_grow(tree)


class GrowsEveryNode(DraftModelTreeProposer):
    """The mutant: p_chain left out of the growth."""

    def to_grow(self, tree):
        return tree.frontier(self.tree_width)


def test_nodes_below_p_chain_are_not_grown():
    assert grown_below_p_chain(DraftModelTreeProposer) == [0, 2]


def test_growing_below_p_chain_is_caught():
    assert grown_below_p_chain(GrowsEveryNode) != [0, 2]


# -- size -------------------------------------------------------------------------------------------------------


def curve(ratios: list[float]) -> CostCurve:
    return CostCurve(128, {1: [0.01 * r for r in ratios], 2: [0.02 * r for r in ratios]})


FLAT = curve([1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14])  # the avx512 kernels': C(8)/C(1) ≈ 1.15
MODERATE = curve([1.0, 1.15, 1.3, 1.45, 1.6, 1.75, 1.9, 2.05])
STEEP = curve([1.0, 1.6, 2.2, 2.8, 3.4, 4.0, 4.6, 5.2])  # an avx2 level's: C(5)/C(1) ≈ 3
PROBS = [[0.9, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02]]  # a tree's branch probabilities, best first


class WholeBudget(TreeSize):
    """The mutant: every node the growth kept is verified, whatever the pass costs."""

    def choose(self, probs, batch_size, draft_s):
        return max(len(p) for p in probs)


def sizes(cls) -> tuple[int, int, int, int]:
    """N on a flat curve, a moderate one, the moderate one after drafts kept none of what the draft expected (20
    steps), and a steep one; drafting took a fifth of C(1)."""
    flat, moderate, steep = cls(lambda: FLAT), cls(lambda: MODERATE), cls(lambda: STEEP)
    before = moderate.choose(PROBS, 1, 0.002)
    for _ in range(20):
        moderate.observe(1.5, 0)
    return flat.choose(PROBS, 1, 0.002), before, moderate.choose(PROBS, 1, 0.002), steep.choose(PROBS, 1, 0.002)


def test_size_follows_the_cost_curve():
    # S(N) = (1 + c·ΣP) / (C(N+1)/C(1) + 0.2): flat, the 0.05 branch still pays its 2 %; moderate, the 0.2 one
    # does not pay its 15 %; once the draft proves overconfident (c ≈ 0.04) or passes are steep, one node.
    assert sizes(TreeSize) == (6, 3, 1, 1)


def test_size_ignoring_the_curve_is_caught():
    assert sizes(WholeBudget) != sizes(TreeSize)


WALL = curve([1.0, 1.05, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0])  # a pass of 3 tokens costs 5: no second node pays
AVX2 = curve([1.0, 1.01, 1.13, 1.36, 1.82, 2.04, 2.3, 2.57])  # measured on an AVX2-only Zen 2 (a 4-row tile)


class GrowsRegardless(TreeSize):
    """The mutant: growth by p_chain alone, whatever the pass would cost."""

    def worth_growing(self, *args) -> bool:
        return True


def grows_a_confident_chain(cls) -> list[bool]:
    """Whether a chain of drafts at 0.95 each grows past depth 1, 2, 3 (a draft pass a third of C(1)), on the flat
    curve, then on the avx2 one."""
    out = []
    for costs in (FLAT, AVX2):
        for depth in (1, 2, 3):
            tree, node = DraftTree(5, 4), -1
            for _ in range(depth):
                tree.add_children(node, [1, 2], [math.log(0.95), math.log(0.01)])
                node = len(tree.tokens) - 2
            out.append(cls(lambda costs=costs: costs).worth_growing([tree], [[node]], 1, 0.003 * depth, 0.003))
    return out


def test_growth_stops_where_another_draft_pass_cannot_pay():
    # On avx2 a fourth draft widens the pass past the tile: C(5)/C(1) 1.82 against 1.36.
    assert grows_a_confident_chain(TreeSize) == [True, True, True, True, True, False]


def test_growth_ignoring_the_curve_is_caught(target, noisy_draft, plain):
    assert grows_a_confident_chain(GrowsRegardless) != grows_a_confident_chain(TreeSize)
    passes = {}
    for cls in (TreeSize, GrowsRegardless):
        engine, proposer = tree_engine(target, noisy_draft, 3, 2, 1, trees_in_batches=False)
        proposer.size = cls(lambda: WALL)
        grow, passes[cls] = proposer.grow, 0

        def counted(*args, grow=grow, cls=cls):
            passes[cls] += 1
            return grow(*args)

        proposer.grow = counted
        assert [engine.generate([engine.add_request(p, GREEDY)])[0].output_ids for p in PROMPTS] == plain
    assert passes[TreeSize] == 0 and passes[GrowsRegardless] > 0


def test_batches_draft_chains_and_adaptive_k_counts_extra_nodes_only_for_unsized_trees(target, noisy_draft):
    engine, proposer = tree_engine(target, noisy_draft, 3, 3, 2, trees_in_batches=False)
    trees = []
    propose, draft_trees = engine.propose, proposer.draft_trees

    def spy(batch, sb):
        out = propose(batch, sb)
        if int(out.n_draft.max()):
            trees.append((len(batch), out.parents is not None))
        return out

    def grown(seqs, ks, batch_size):
        trees.append((batch_size, "grown"))
        return draft_trees(seqs, ks, batch_size)

    engine.propose, proposer.draft_trees = spy, grown
    engine.generate([engine.add_request(p, GREEDY) for p in PROMPTS[:2]])
    alone = engine.add_request(PROMPTS[2], GREEDY)
    engine.generate([alone])
    # Alone, trees are grown (those trimmed to a chain go as one); in a batch, chains only.
    assert {t for t in trees if t[0] == 2} == {(2, False)}
    assert (1, "grown") in trees
    # Sized by the curve, a tree's siblings come only where they pay: adaptive k judges its depth as a chain's.
    assert (proposer.extra_nodes_at(1), proposer.extra_nodes_at(2)) == (0, 0)
    proposer.size.curve = None  # the whole budget always: its siblings widen every pass alone
    assert (proposer.extra_nodes_at(1), proposer.extra_nodes_at(2)) == (2, 0)
    policy, chain = (AdaptiveK(STEEP, 3, extra_nodes=2, extra_at=proposer.extra_nodes_at), AdaptiveK(STEEP, 3))
    for p in (policy, chain):
        p.alpha = 0.9
    assert policy.best([0, 0], [3, 3]) == chain.best([0, 0], [3, 3])
    assert policy.best([0], [3]) != chain.best([0], [3])


# -- configuration ----------------------------------------------------------------------------------------------


def test_tree_width_for_a_draft_model():
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": "/d", "num_speculative_tokens": 4,
                                   "tree_width": 3})
    assert (cfg.tree_width, cfg.proposer) == (3, "draft_model+tree")
    args = build_parser().parse_args(["generate", "hi", "--draft-model", "/d", "--tree-width", "3"])
    cfg = speculative_config_from_args(args)
    assert (cfg.method, cfg.tree_width, cfg.lookup_first) == ("draft_model", 3, True)


def test_generate_reports_nodes_and_accepted_drafts_per_pass():
    from speculant.cli import tree_stats
    from speculant.timing import EngineTiming

    timing = EngineTiming(passes={1: [2, 0.1], 4: [3, 0.3], 6: [1, 0.1]})  # 3 passes of 3 nodes, 1 of 5
    m = {"num_drafts": 4, "num_accepted_tokens": 6}
    assert tree_stats(timing, m, "draft_model+lookup+tree") == (" | nodes verified per pass 3.50, accepted per "
                                                                  "pass 1.50")
    assert tree_stats(timing, m, "draft_model+lookup") == ""


@pytest.mark.parametrize("batch", [1, 2])
def test_sliding_window_trees_are_plain_greedy(tmp_path, batch):
    """A Mistral-style target with a window shorter than its prompts, drafted by itself: each tree node sees the
    window its branch would see decoded alone, not every cached key."""
    folder = save_tiny(tmp_path / "mistral", transformers.MistralConfig, seed=0, num_hidden_layers=2,
                       sliding_window=6, init_std=0.05)
    target = load_model(folder)
    prompts = [[(7 * i) % 90 + 3 for i in range(30)], [(11 * i) % 90 + 3 for i in range(30)]]
    alone = Engine(target, max_batch_size=1, max_model_len=64)
    plain = [alone.generate([alone.add_request(p, GREEDY)])[0].output_ids for p in prompts]
    engine, _ = tree_engine(target, folder, 3, 2, batch, curve=False)
    trees, verify = [0], engine.verify

    def spy(proposal, logits, sb):  # count the passes that verified a tree with siblings
        trees[0] += proposal.parents is not None and any(len(set(p)) < len(p) for p in proposal.parents)
        return verify(proposal, logits, sb)

    engine.verify = spy
    assert [s.output_ids for s in engine.generate([engine.add_request(p, GREEDY) for p in prompts])] == plain
    assert engine.stats.num_accepted_tokens > 0 and trees[0] > 0
