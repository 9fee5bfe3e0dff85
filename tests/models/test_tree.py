"""Draft trees (EAGLE's tree_width): tree attention scores each branch as if decoded alone, greedy
verification follows the branch the target takes, and output stays plain greedy output."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny, transformers
from mutants import patch_coupling
from test_distribution import ALPHA, N_SAMPLES, N_TOKENS, SETTINGS, exact_joint, g_test, sampled_joint
from test_eagle import BATCH, eagle_engine, saved_head

from speculant.arguments import speculative_config_from_args
from speculant.cli import build_parser
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.llm import engine_for
from speculant.models import native
from speculant.models.attention import tree_layout
from speculant.models.loader import load_model
from speculant.proposers.draft_tree import DraftTree
from speculant.proposers.eagle import EagleProposer, load_eagle
from speculant.verify import follow_tree

# Below the cached prompt: a → b → c, a → d → e, f (three branches, parents before children).
TREE_TOKENS = [11, 22, 33, 44, 55, 66]
TREE_PARENTS = [-1, 0, 1, 0, 3, -1]
BRANCHES = [[11, 22, 33], [11, 44, 55], [66]]
NODES = [[0, 1, 2], [0, 3, 4], [5]]  # each branch's nodes in the tree


def tree_and_branches(model, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hidden states of one tree pass after the prompt, and of each branch decoded alone, token by token."""
    slot = torch.tensor([0])
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        model(prompt[None], cache, slot)
        tree = model(torch.tensor([TREE_TOKENS]), cache, slot, parents=[TREE_PARENTS])[0]
        branches = []
        for branch in BRANCHES:
            cache.rollback(0, len(prompt))
            branches.append(torch.cat([model(torch.tensor([[t]]), cache, slot)[0] for t in branch]))
    return tree, branches


def row_by_row(monkeypatch) -> None:
    """The library kernels' path: attention row by row (what runs without the native kernels)."""
    monkeypatch.setattr(native, "attention_usable", lambda head_dim: False)
    monkeypatch.setattr(native, "layer_ops_usable", lambda x: False)


# A window of 2 hides cached keys from every node and the grandparent from a node at depth 2.
@pytest.mark.parametrize("window", [None, 2, 16])
@pytest.mark.parametrize("path", ["float32", "bfloat16 native", "bfloat16 row by row"])
def test_tree_pass_scores_each_branch_as_decoded_alone(tmp_path, monkeypatch, path, window):
    if path == "bfloat16 native" and not native.attention_usable(64):
        pytest.skip("the native attention kernel does not run here (no AVX2, or no compiler)")
    if path == "bfloat16 row by row":
        row_by_row(monkeypatch)
    arch = {} if window is None else dict(config_cls=transformers.MistralConfig, sliding_window=window)
    folder = save_tiny(tmp_path, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=256, init_std=0.05, **arch)
    model = load_model(folder, dtype=path.split()[0]).model
    prompt = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(0))
    tree, branches = tree_and_branches(model, prompt)
    for nodes, alone in zip(NODES, branches):
        if path == "float32":  # PyTorch's attention sums a masked row in another order
            torch.testing.assert_close(tree[nodes], alone, rtol=1e-5, atol=1e-5)
        else:  # bf16 speculation is exact only if a branch's bits are its own
            assert torch.equal(tree[nodes], alone), nodes


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("path", ["float32", "bfloat16 row by row"])
def test_tree_pass_in_a_ragged_batch(tmp_path, monkeypatch, path, window):
    """Two rows, different cache lengths, a tree in one, a chain with padding in the other; bf16 bit for bit."""
    if path == "bfloat16 row by row":
        row_by_row(monkeypatch)
    arch = {} if window is None else dict(config_cls=transformers.MistralConfig, sliding_window=window)
    model = load_model(save_tiny(tmp_path, seed=0, num_hidden_layers=3, init_std=0.05, **arch),
                       dtype=path.split()[0]).model
    same = torch.testing.assert_close if path == "float32" else lambda a, b, **_: torch.equal(a, b) or pytest.fail(
        "a row's bits depend on the batch")
    slots = torch.tensor([0, 1])
    with torch.no_grad():
        cache = model.new_cache(2, 64)
        model(torch.tensor([[5, 6, 7, 8, 9]]), cache, slots[:1])
        model(torch.tensor([[3, 4]]), cache, slots[1:])
        tokens = torch.tensor([TREE_TOKENS, [40, 41, 0, 0, 0, 0]])
        chain = list(range(-1, 5))
        out = model(tokens, cache, slots, torch.tensor([6, 2]), parents=[TREE_PARENTS, chain])
        alone = model.new_cache(1, 64)
        model(torch.tensor([[3, 4, 40, 41]]), alone, torch.tensor([0]))
        for nodes, branch in zip(NODES, BRANCHES):
            alone.rollback(0, 0)
            expected = model(torch.tensor([[5, 6, 7, 8, 9, *branch]]), alone, torch.tensor([0]))[0, 5:]
            same(out[0, nodes], expected, rtol=1e-5, atol=1e-5)
        alone.rollback(0, 0)
        same(out[1, :2], model(torch.tensor([[3, 4, 40, 41]]), alone,
                                                     torch.tensor([0]))[0, 2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target_tokens, path, next_token", [
    ([11, 22, 33, 7, 8, 9, 1], [0, 1, 2], 7),  # the first branch to its end, then the target's token
    ([11, 44, 0, 0, 55, 3, 0], [0, 3, 4], 3),  # the second branch: a's child d, not b
    ([66, 0, 0, 0, 0, 0, 5], [5], 5),  # the last candidate for the first draft
    ([11, 99, 0, 0, 0, 0, 0], [0], 99),  # a matches, none of its children
    ([12, 0, 0, 0, 0, 0, 0], [], 12),  # no candidate matches
])
def test_greedy_tree_verification_follows_the_targets_branch(target_tokens, path, next_token):
    # target_tokens[0]: the target's token after the sequence; [j + 1]: after draft j.
    assert follow_tree(TREE_TOKENS, TREE_PARENTS, 6, lambda column, offset: target_tokens[column]) == (path, next_token)


def test_padding_drafts_are_never_accepted():
    path, _ = follow_tree(TREE_TOKENS, TREE_PARENTS, 5, lambda column, offset: [66, 0, 0, 0, 0, 0, 0][column])
    assert path == []


def count_sibling_paths(engine: Engine) -> list[int]:
    """Spy on verification: how many accepted branches went through another candidate than the first."""
    seen = [0]
    original = engine.verify

    def spy(proposal, logits, sb):
        accepted, next_tokens = original(proposal, logits, sb)
        if proposal.parents is not None:
            seen[0] += sum(1 for path, tree in zip(accepted, proposal.parents) if path and path[0] > 0
                           and tree[path[0]] == -1)
        return accepted, next_tokens

    engine.verify = spy
    return seen


PROMPTS = [[1, 5, 9, 14], [1, 33, 2, 7, 7, 7, 7, 40, 41], [1, 60], [3, 4, 5, 3, 4, 5, 3]]


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return str(saved_head(target, tmp_path_factory.mktemp("head")))


@pytest.fixture(scope="module")
def plain(target):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = Engine(target, max_batch_size=4, max_model_len=64)
    return [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in PROMPTS])]


@pytest.mark.parametrize("extra", [{}, {"lookup_first": True}, {"lookup_first": True, "adaptive": True}])
@pytest.mark.parametrize("k, width", [(1, 3), (3, 4), (4, 8)])
def test_greedy_tree_output_is_plain_greedy(target, head, plain, k, width, extra):
    spec = SpeculativeConfig.parse({"method": "eagle", "model": head, "num_speculative_tokens": k,
                                    "tree_width": width, **extra})
    # Three slots for four requests: one joins mid-way.
    engine = engine_for(target, spec, 3, 64)
    assert engine.proposer.name == spec.proposer  # eagle+tree, eagle+lookup+tree: logs and metrics say so
    siblings = count_sibling_paths(engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in PROMPTS])]
    assert got == plain
    assert engine.stats.num_accepted_tokens > 0
    if not extra.get("adaptive"):  # adaptive k may leave the head off on a random head's drafts
        assert siblings[0] > 0, siblings  # the kept branch was another first candidate: its keys were moved


def test_deep_wide_tree_is_plain_greedy(target, head, plain):
    """The largest tree a config allows (8 wide, 25 deep, 32 nodes) drafts and stays plain greedy."""
    spec = SpeculativeConfig.parse({"method": "eagle", "model": head, "num_speculative_tokens": 25,
                                    "tree_width": 8})
    engine = engine_for(target, spec, 2, 64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in PROMPTS])] == plain


def test_cache_holds_the_kept_branch(target, head):
    """After generating with a tree, the target's cache row holds what a fresh pass over the sequence
    computes: the kept branch's keys and values were moved where the sequence continues."""
    spec = SpeculativeConfig.parse({"method": "eagle", "model": head, "num_speculative_tokens": 2, "tree_width": 6})
    engine = engine_for(target, spec, len(PROMPTS), 64)  # a slot each: no row's cache is reused
    siblings = count_sibling_paths(engine)
    rows, release = {}, engine.cache.release  # each row as its sequence leaves it (its pages go back then)

    def keep(slot):
        rows[slot] = (engine.cache.k[:, slot].clone(), engine.cache.v[:, slot].clone())
        release(slot)

    engine.cache.release = keep
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seqs = engine.generate([engine.add_request(p, params) for p in PROMPTS])
    assert siblings[0] > 0
    model = target.model
    for seq in seqs:
        n = seq.num_cached
        with torch.no_grad():
            fresh = model.new_cache(1, 64)
            model(torch.tensor([seq.tokens[:n]]), fresh, torch.tensor([0]))
        for cache, expected in zip(rows[seq.slot], (fresh.k, fresh.v)):
            torch.testing.assert_close(cache[:, :, :n], expected[:, 0, :, :n], rtol=1e-5, atol=1e-5)


def test_greedy_rows_next_to_sampled_rows(target, head, plain):
    """In a mixed batch the sampled rows' trees go through the acceptance rule and a greedy row still
    gives plain greedy output."""
    spec = SpeculativeConfig.parse({"method": "eagle", "model": head, "num_speculative_tokens": 3,
                                    "tree_width": 3})
    engine = engine_for(target, spec, 4, 64)
    trees = []  # (a sampled row in the batch, the drafts a tree)
    original = engine.propose

    def spy(batch, sb):
        out = original(batch, sb)
        trees.append((not sb.all_greedy, out.parents is not None))
        return out

    engine.propose = spy
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=1)
    seqs = [engine.add_request(PROMPTS[0], greedy), engine.add_request(PROMPTS[1], sampled)]
    engine.generate(seqs)
    assert seqs[0].output_ids == plain[0]
    assert (True, True) in trees


def test_seeded_sampled_tree_writes_the_plain_tokens(target, head):
    """A sampled row's tree is verified by coupling: with a seed, its output is plain sampled output,
    token for token, alone or beside other rows."""
    params = [SamplingParams(temperature=0.3, seed=seed, max_tokens=24, ignore_eos=True) for seed in range(4)]
    plain_engine = Engine(target, max_batch_size=1, max_model_len=64)
    plain = [plain_engine.generate([plain_engine.add_request(p, sp)])[0].output_ids for p, sp in zip(PROMPTS, params)]
    spec = SpeculativeConfig.parse({"method": "eagle", "model": head, "num_speculative_tokens": 3,
                                    "tree_width": 3})
    engine = engine_for(target, spec, 4, 64)
    siblings = count_sibling_paths(engine)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)])]
    assert got == plain
    assert engine.stats.num_accepted_tokens > 0 and siblings[0] > 0


@pytest.fixture(scope="module")
def small(small_vocab_pair, tmp_path_factory):
    target = load_model(small_vocab_pair[0])
    return target, load_eagle(saved_head(target, tmp_path_factory.mktemp("head")), target)


@pytest.mark.parametrize("setting", ["t1", "t0.7_topk", "topp"])
@pytest.mark.parametrize("k, width", [(1, 3), (2, 4)])
def test_sampled_tree_matches_target(small, setting, k, width):
    target, head = small
    params = SETTINGS[setting]
    engine = eagle_engine(target, head, k, BATCH, tree_width=width)
    siblings = count_sibling_paths(engine)
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(target.model, params, N_TOKENS))
    print(f"eagle tree k={k} width={width} {setting}: G-test p = {p:.4f}, {siblings[0]} sibling branches kept")
    assert siblings[0] > 0
    assert p > ALPHA


def test_siblings_tested_against_draws_of_their_own_are_caught(small, monkeypatch):
    """The mutant: a node's candidates are each compared with a draw of their own, where coupling
    compares them all with the one token the target draws there."""
    patch_coupling("each_candidate_its_own_draw", monkeypatch)
    target, head = small
    params = SETTINGS["t1"]
    engine = eagle_engine(target, head, 1, BATCH, tree_width=3)
    assert g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(target.model, params, N_TOKENS)) < ALPHA


def test_tree_width_is_validated():
    base = {"method": "eagle", "model": "/x", "num_speculative_tokens": 4}
    for width in (0, 9, 2.0, True):
        with pytest.raises(SpeculantError, match=r"tree_width=.* is out of range \[1, 8\]"):
            SpeculativeConfig.parse({**base, "tree_width": width})
    with pytest.raises(SpeculantError, match="tree_width .* needs method eagle"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "tree_width": 2})
    with pytest.raises(SpeculantError, match="num_speculative_tokens \\+ tree_width - 1 = 33 drafts a step"):
        SpeculativeConfig.parse({**base, "num_speculative_tokens": 30, "tree_width": 4})
    assert SpeculativeConfig.parse({**base, "tree_width": 3}).tree_width == 3


def test_tree_width_flag():
    parser = build_parser()
    cfg = speculative_config_from_args(parser.parse_args(["generate", "hi", "--eagle", "/h", "--tree-width", "3"]))
    assert (cfg.method, cfg.tree_width) == ("eagle", 3)
    for given in (["--eagle", "/h"], ["--speculative-config", '{"method": "eagle", "model": "/h", '
                                                             '"num_speculative_tokens": 2, "tree_width": 3}']):
        with pytest.raises(SpeculantError, match=r"tree_width=0 is out of range \[1, 8\]"):
            speculative_config_from_args(parser.parse_args(["generate", "hi", *given, "--tree-width", "0"]))
    with pytest.raises(SpeculantError, match="--tree-width .* give --eagle PATH"):
        speculative_config_from_args(parser.parse_args(["generate", "hi", "--tree-width", "3"]))


def reference_tree(proposer: EagleProposer, snapshot: tuple, slot: int, feature: torch.Tensor, k: int) -> tuple:
    """The tree the head should draft, each node's feature from its branch decoded alone, one token at a
    time, from the head's cache as it was before drafting."""
    head, width = proposer.head, proposer.tree_width
    keys, values, lengths = snapshot
    tree = DraftTree(k + width - 1, k)
    slots = torch.tensor([slot])

    def branch_feature(node: int) -> torch.Tensor:
        proposer.cache.k.copy_(keys)
        proposer.cache.v.copy_(values)
        proposer.cache.lengths.copy_(lengths)
        path = []
        while node >= 0:
            path.insert(0, node)
            node = tree.parents[node]
        f = feature
        for n in path:
            f = head(proposer.target.model.embed_tokens(torch.tensor([[tree.tokens[n]]])), f, proposer.cache, slots)
        return f

    def grow(node: int) -> None:
        f = feature if node < 0 else branch_feature(node)
        top = torch.log_softmax(proposer.lm_head(f).float()[0, 0], dim=-1).topk(width)
        tree.add_children(node, proposer._vocab_ids(top.indices).tolist(), top.values.tolist())

    grow(-1)
    while nodes := tree.frontier(width):
        for n in nodes:
            grow(n)
    return tree.best()


@pytest.mark.parametrize("k, width", [(3, 2), (4, 3)])
def test_head_drafts_each_branch_as_if_decoded_alone(target, head, k, width):
    """The tree's head passes (each a tree over the branches grown so far) give every node the feature
    its branch gets decoded alone: the same tree as growing it branch by branch."""
    spec = SpeculativeConfig.parse({"method": "eagle", "model": head, "num_speculative_tokens": k,
                                    "tree_width": width})
    engine = engine_for(target, spec, 2, 64)
    proposer = engine.proposer
    checked = []
    original = proposer._draft_tree

    def spy(feature, slots, ks):
        cache = proposer.cache
        snapshot = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
        proposal = original(feature, slots, ks)
        after = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
        for b, slot in enumerate(slots.tolist()):
            n = int(proposal.n_draft[b])
            expected = reference_tree(proposer, snapshot, slot, feature[b:b + 1], ks[b])
            assert (proposal.tokens[b, :n].tolist(), proposal.parents[b][:n]) == expected
            checked.append(max(tree_layout([proposal.parents[b][:n]])[0][0]))
        cache.k.copy_(after[0])
        cache.v.copy_(after[1])
        cache.lengths.copy_(after[2])
        return proposal

    proposer._draft_tree = spy
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate([engine.add_request(p, params) for p in PROMPTS[:2]])
    assert len(checked) > 4 and max(checked) >= 1, checked  # trees with nodes below depth 1 were drafted
