"""The EAGLE proposer: lossless (greedy and sampled), exact cache bookkeeping, target check."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny
from test_distribution import ALPHA, N_SAMPLES, N_TOKENS, PROMPT, SETTINGS, exact_joint, g_test, sampled_joint

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.proposers.eagle import EagleHead, EagleProposer, head_config, load_eagle, save_eagle
from speculant.sampling import probabilities

# Seeded requests here are judged as unseeded ones are (conftest.rule_path): the acceptance rule's path.
pytestmark = pytest.mark.usefixtures("rule_path")

BATCH = 400


def random_head(target, seed: int = 0, std: float = 0.3, vocab: torch.Tensor | None = None) -> EagleHead:
    """An untrained head with large weights: its drafts are sometimes right, often wrong, and its
    q clearly differs from p, which is what the losslessness tests need."""
    torch.manual_seed(seed)
    head = EagleHead(head_config(target.config), vocab)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
    return head.eval().requires_grad_(False)


def saved_head(target, folder, seed: int = 0, vocab: torch.Tensor | None = None):
    save_eagle(random_head(target, seed, vocab=vocab), folder, target, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module")
def small(small_vocab_pair, tmp_path_factory):
    target = load_model(small_vocab_pair[0])
    return target, load_eagle(saved_head(target, tmp_path_factory.mktemp("head")), target)


DRAFT_VOCAB = torch.tensor([0, 2, 3, 5, 6])  # of the small target's 8 tokens


@pytest.fixture(scope="module")
def small_draft_vocab(small_vocab_pair, tmp_path_factory):
    """A head that drafts from 5 of the 8 tokens: q is 0 on the other 3, where p is not."""
    target = load_model(small_vocab_pair[0])
    return target, load_eagle(saved_head(target, tmp_path_factory.mktemp("head"), vocab=DRAFT_VOCAB), target)


def eagle_engine(target, head, k: int, batch: int, proposer_cls=EagleProposer, max_len: int = 32,
                 tree_width: int = 1) -> Engine:
    proposer = proposer_cls(head, target.model, batch, max_len + k + 1, tree_width, k)
    return Engine(target, proposer, k,
                  max_batch_size=batch, max_model_len=max_len)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_plain_greedy(tiny_pair, tmp_path, k):
    target = load_model(tiny_pair[0])
    spec = SpeculativeConfig.parse({"method": "eagle", "model": str(saved_head(target, tmp_path)),
                                    "num_speculative_tokens": k})
    prompts = [[1, 5, 9, 14], [1, 33, 2, 7, 7, 7, 7, 40, 41], [1, 60], [3, 4, 5, 3, 4, 5, 3]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = Engine(target, max_batch_size=4, max_model_len=64)
    expected = [s.output_ids for s in plain.generate([plain.add_request(p, params) for p in prompts])]
    # Three slots for four requests: one joins mid-way, as in continuous batching.
    proposer = build_proposer(spec, target, 3, 64 + k + 1)
    engine = Engine(target, proposer, k, max_batch_size=3, max_model_len=64)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])]
    assert got == expected
    assert engine.stats.num_draft_tokens > 0


@pytest.mark.parametrize("tree_width", [1, 3])
def test_head_cache_matches_a_fresh_run(small, tree_width):
    """At every step the first draft equals what the head predicts when run from scratch on the
    target's features of the whole sequence: rollback and catch-up lose nothing (nor does a draft
    tree, whose kept branch may be another first candidate than the one the head continued)."""
    target, head = small
    model = target.model
    engine = eagle_engine(target, head, 3, 1, tree_width=tree_width)
    proposer = engine.proposer
    checked = []
    original = proposer.propose

    def spy(seqs, ks, sb):
        out = original(seqs, ks, sb)
        tokens = seqs[0].tokens
        if out.n_draft[0] and len(tokens) > 1:
            ids = torch.tensor([tokens[:-1]])
            features = model(ids, model.new_cache(1, len(tokens)), torch.tensor([0]))
            embeds = model.model.embed_tokens(torch.tensor([tokens[1:]]))
            pred = head(embeds, features, head.new_cache(1, len(tokens)), torch.tensor([0]))[:, -1:]
            checked.append(int(model.logits(pred).argmax(-1)) == int(out.tokens[0, 0]))
        return out

    proposer.propose = spy
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.generate([engine.add_request(PROMPT, params)])
    assert len(checked) > 3 and all(checked)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_eagle_sampling_matches_target(small, setting):
    target, head = small
    params = SETTINGS[setting]
    engine = eagle_engine(target, head, 2, BATCH)
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(target.model, params, N_TOKENS))
    print(f"eagle {setting}: G-test p = {p:.4f}")
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA


@pytest.mark.parametrize("setting", ["t1", "t0.7_topk"])
def test_draft_vocabulary_sampling_matches_target(small_draft_vocab, setting):
    target, head = small_draft_vocab
    assert head.vocab.tolist() == DRAFT_VOCAB.tolist()  # saved and loaded with the head
    params = SETTINGS[setting]
    engine = eagle_engine(target, head, 2, BATCH)
    drafted = []
    original = engine.proposer.propose

    def spy(seqs, ks, sb):
        out = original(seqs, ks, sb)
        drafted.extend(out.tokens[out.n_draft > 0].flatten().tolist())
        return out

    engine.proposer.propose = spy
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(target.model, params, N_TOKENS))
    print(f"eagle, draft vocabulary {DRAFT_VOCAB.tolist()}, {setting}: G-test p = {p:.4f}")
    assert drafted and set(drafted) <= set(DRAFT_VOCAB.tolist())
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA


def test_draft_vocabulary_greedy_is_plain_greedy(small_draft_vocab):
    target, head = small_draft_vocab
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(target, max_batch_size=2, max_model_len=40)
    expected = [s.output_ids for s in plain.generate([plain.add_request(PROMPT, params),
                                                       plain.add_request([1, 2, 3], params)])]
    engine = eagle_engine(target, head, 3, 2, max_len=40)
    got = [s.output_ids for s in engine.generate([engine.add_request(PROMPT, params),
                                                   engine.add_request([1, 2, 3], params)])]
    assert got == expected
    assert engine.stats.num_accepted_tokens > 0


class GreedyHeadSoftmaxQ(EagleProposer):
    """Drafts the head's argmax but reports the softmax as q: the classic lossy bug."""

    def draw(self, logits, sb):
        q = probabilities(logits, sb)[:, 0]
        return q.argmax(dim=-1), q


class DraftVocabQMisplaced(EagleProposer):
    """Reports q over the draft vocabulary at the first N ids instead of the vocabulary's own."""

    def draw_from_vocab(self, logits, sb):
        token, q = self.draw(logits, sb)
        n = len(self.head.vocab)
        full = torch.zeros(q.shape[0], self.target.cfg.vocab_size)
        full[:, :n] = q
        return self.head.vocab[token], full


@pytest.mark.parametrize("mutant, head_fixture, setting", [(GreedyHeadSoftmaxQ, "small", "t0.7_topk"),
                                                           (DraftVocabQMisplaced, "small_draft_vocab", "t1")])
def test_eagle_mutant_is_caught(mutant, head_fixture, setting, request):
    target, head = request.getfixturevalue(head_fixture)
    engine = eagle_engine(target, head, 2, BATCH, proposer_cls=mutant)
    p = g_test(sampled_joint(engine, SETTINGS[setting], N_SAMPLES),
               exact_joint(target.model, SETTINGS[setting], N_TOKENS))
    assert p < ALPHA


def test_head_for_another_target_is_refused(tiny_pair, tmp_path):
    target = load_model(tiny_pair[0])
    head = saved_head(target, tmp_path / "head")
    same_shape = load_model(save_tiny(tmp_path / "other", seed=7, num_hidden_layers=3))
    other_shape = load_model(tiny_pair[1])
    for other in (same_shape, other_shape):
        spec = SpeculativeConfig.parse({"method": "eagle", "model": str(head), "num_speculative_tokens": 2})
        with pytest.raises(SpeculantError, match="trained for target 'target'.*not for the loaded target"):
            build_proposer(spec, other, 1, 32)
    load_eagle(head, load_model(tiny_pair[0], dtype="bfloat16"))  # the same target in another dtype is fine


def test_draft_vocabulary_outside_the_target_is_refused(tiny_pair, tmp_path):
    target = load_model(tiny_pair[0])
    vocab = torch.tensor([0, 3, target.config.vocab_size])
    head = saved_head(target, tmp_path, vocab=vocab)
    with pytest.raises(SpeculantError, match=r"draft vocabulary must list token ids in \[0, "):
        load_eagle(head, target)


def test_missing_files_are_reported(tiny_pair, tmp_path):
    target = load_model(tiny_pair[0])
    with pytest.raises(SpeculantError, match="eagle.safetensors and eagle_config.json"):
        load_eagle(tmp_path, target)


def test_a_long_prompt_joining_next_to_a_row_near_its_context_end(tiny_pair, tmp_path):
    """The head catches up on a new row's whole prompt in the same pass as one token of a row with
    few positions left: that row's padding lands in its cache's sink, and outputs stay plain greedy."""
    target = load_model(tiny_pair[0])
    spec = SpeculativeConfig.parse({"method": "eagle", "model": str(saved_head(target, tmp_path)),
                                    "num_speculative_tokens": 2})
    gen = torch.Generator().manual_seed(5)
    near_end, short, long_prompt = ([1] + torch.randint(3, 96, (n,), generator=gen).tolist() for n in (44, 2, 40))
    prompts = [near_end, short, long_prompt]
    budgets = [18, 3, 8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in budgets]
    plain = Engine(target, max_batch_size=1, max_model_len=64)
    expected = [plain.generate([plain.add_request(p, sp)])[0].output_ids for p, sp in zip(prompts, params)]
    engine = Engine(target, build_proposer(spec, target, 2, 64 + 3), 2, max_batch_size=2, max_model_len=64)
    got = [s.output_ids for s in engine.generate([engine.add_request(p, sp) for p, sp in zip(prompts, params)])]
    assert got == expected
