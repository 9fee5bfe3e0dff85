"""Speculative sampling follows the target's distribution exactly.

The joint distribution of the first three generated tokens, sampled N times through the
speculative engine, is compared with the target's exact distribution (enumerated on a
vocabulary of 8) by a G-test at significance ALPHA. The same test must reject each mutant.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from mutants import (
    PROPOSER_MUTANTS,
    VERIFIER_MUTANTS,
    inverse_cdf_sample,
    patch_coupling,
    patch_mixed_rows,
    patch_verifier,
)
from scipy.stats import power_divergence

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers.draft_model import DraftModelProposer
from speculant.proposers.lookup_first import LookupFirstProposer
from speculant.proposers.ngram import NgramProposer
from speculant.sampling import SamplingBatch, probabilities

# Seeded requests here are judged as unseeded ones are (conftest.rule_path): the acceptance rule's path.
pytestmark = pytest.mark.usefixtures("rule_path")

ALPHA = 1e-3
N_SAMPLES = 6000
N_TOKENS = 3
PROMPT = [1, 5, 3, 6, 1, 5]
BATCH = 400

SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk": SamplingParams(temperature=0.7, top_k=4),
    "topp": SamplingParams(temperature=1.0, top_p=0.8),
    "minp": SamplingParams(temperature=1.0, min_p=0.15),
}


def exact_joint(model, params: SamplingParams, n_tokens: int) -> dict[tuple, float]:
    """P(t1..tn | prompt) under the request's transforms, by enumeration."""
    sb = SamplingBatch.build([params], [None], model.device)
    joint = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, mass in joint.items():
            cache = model.new_cache(1, len(PROMPT) + n_tokens)
            ids = torch.tensor([PROMPT + list(prefix)])
            p = probabilities(model.logits(model(ids, cache, torch.tensor([0]))[:, -1:]), sb)[0, 0]
            for tok in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(p[tok])
        joint = nxt
    return joint


def sampled_joint(engine: Engine, params: SamplingParams, n: int, seed: int = 0) -> Counter:
    counts: Counter = Counter()
    for start in range(0, n, BATCH):
        seqs = [engine.add_request(PROMPT, replace(params, seed=seed + start + i, max_tokens=N_TOKENS,
                                                   ignore_eos=True))
                for i in range(min(BATCH, n - start))]
        engine.generate(seqs)
        counts.update(tuple(s.output_ids) for s in seqs)
    return counts


def g_test(counts: Counter, exact: dict[tuple, float]) -> float:
    """p-value of a G-test; cells with expected count < 5 are pooled, impossible outcomes too."""
    n = sum(counts.values())
    big = [c for c, pr in exact.items() if pr * n >= 5]
    obs = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    exp = [exact[c] * n for c in big] + [n * (1 - sum(exact[c] for c in big))]
    impossible = sum(v for c, v in counts.items() if c not in exact)
    if impossible:
        return 0.0
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # rounding only
    return float(power_divergence(obs, exp, lambda_="log-likelihood").pvalue)


@pytest.fixture(scope="module")
def models(small_vocab_pair):
    target, draft = small_vocab_pair
    return load_model(target), load_model(draft)


def draft_engine(models, k: int = 2, proposer_cls=DraftModelProposer) -> Engine:
    target, draft = models
    proposer = proposer_cls(draft, target.config.vocab_size, BATCH, 64)
    return Engine(target, proposer, k, max_batch_size=BATCH, max_model_len=32)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_draft_model_sampling_matches_target(models, setting):
    params = SETTINGS[setting]
    p = g_test(sampled_joint(draft_engine(models), params, N_SAMPLES), exact_joint(models[0].model, params, N_TOKENS))
    print(f"{setting}: G-test p = {p:.4f}")
    assert p > ALPHA


NGRAM_SETTINGS = {"t0.7": SamplingParams(temperature=0.7), **SETTINGS}


@pytest.mark.parametrize("native_sampler", [True, False])
@pytest.mark.parametrize("setting", list(NGRAM_SETTINGS))
def test_ngram_sampling_matches_target(models, native_sampler, setting, monkeypatch):
    """Deterministic drafts (q one-hot), verified by coupling: kept while each is the target's token drawn
    at its position as plain decoding draws it; on the native sampler (sampling.cpp) and on PyTorch's
    (`sampling.inverse_cdf`)."""
    from speculant.models import native

    if native_sampler and not native.sampling_usable(torch.zeros(1)):
        pytest.skip("the native sampler does not run here (no AVX2, or no compiler)")
    if not native_sampler:
        monkeypatch.setattr(native, "sampling_usable", lambda x: False)
    engine = Engine(models[0], NgramProposer(1, 3), 3, max_batch_size=BATCH, max_model_len=32)
    params = NGRAM_SETTINGS[setting]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(models[0].model, params, N_TOKENS))
    print(f"{setting}, native {native_sampler}: G-test p = {p:.4f}")
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA


@pytest.mark.parametrize("native_sampler", [True, False])
@pytest.mark.parametrize("setting", ["t0.7_topk", "topp"])
def test_seeded_lookup_sampling_writes_the_plain_tokens(models, native_sampler, setting, monkeypatch):
    """Coupling keeps a draft where it is the token plain decoding draws there: 400 seeded requests
    write with lookup drafts exactly what they write without, in a batch of 400 as alone."""
    from speculant.models import native

    if native_sampler and not native.sampling_usable(torch.zeros(1)):
        pytest.skip("the native sampler does not run here (no AVX2, or no compiler)")
    if not native_sampler:
        monkeypatch.setattr(native, "sampling_usable", lambda x: False)
    requests = [replace(NGRAM_SETTINGS[setting], seed=i, max_tokens=12, ignore_eos=True) for i in range(BATCH)]
    plain = Engine(models[0], max_batch_size=1, max_model_len=32)
    expected = [plain.generate([plain.add_request(PROMPT, r)])[0].output_ids for r in requests[:20]]
    plain = Engine(models[0], max_batch_size=BATCH, max_model_len=32)
    expected += [s.output_ids for s in plain.generate([plain.add_request(PROMPT, r) for r in requests[20:]])]
    engine = Engine(models[0], NgramProposer(1, 3), 3, max_batch_size=BATCH, max_model_len=32)
    assert [s.output_ids for s in engine.generate([engine.add_request(PROMPT, r) for r in requests])] == expected
    assert engine.stats.num_accepted_tokens > 500


class LookupBesideModelRows(LookupFirstProposer):
    """Lookup drafts in the seeded rows, the draft model's in the others: both kinds of row in every step."""

    def propose(self, seqs, ks, sb):
        seeded = [s.params.seed is not None for s in seqs]
        found = self.lookup.propose(seqs, [k if s else 0 for k, s in zip(ks, seeded)], sb)
        return self.complete(seqs, found, [0 if s else k for k, s in zip(ks, seeded)], sb)


def seeded_lookup_beside_model_rows(models) -> tuple[list[list[int]], list[list[int]], Engine]:
    """200 seeded requests with lookup drafts beside 200 unseeded ones with the draft model's, in one batch
    → (their outputs, plain decoding's, the engine)."""
    requests = [replace(NGRAM_SETTINGS[s], seed=i, max_tokens=12, ignore_eos=True)
                for i in range(BATCH // 4) for s in ("t0.7_topk", "topp")]
    plain = Engine(models[0], max_batch_size=BATCH, max_model_len=32)
    expected = [s.output_ids for s in plain.generate([plain.add_request(PROMPT, r) for r in requests])]
    proposer = LookupBesideModelRows(NgramProposer(1, 3), DraftModelProposer(models[1], 8, BATCH, 64))
    engine = Engine(models[0], proposer, 3, max_batch_size=BATCH, max_model_len=32)
    others = [replace(r, seed=None) for r in requests]
    seqs = engine.generate([engine.add_request(PROMPT, r) for r in requests + others])
    return [s.output_ids for s in seqs[:len(requests)]], expected, engine


def test_seeded_lookup_rows_beside_model_rows_write_the_plain_tokens(models):
    """A step's rows are verified each its own way: the seeded lookup rows by coupling, the model's by the
    rule, so the lookup rows write plain decoding's tokens in a batch with draft-model rows as alone."""
    got, expected, engine = seeded_lookup_beside_model_rows(models)
    assert got == expected
    assert engine.stats.num_accepted_tokens > 500


def test_every_row_by_the_rule_is_caught(models, monkeypatch):
    """Every row through the rule once one carries q (lookup rows with a one-hot q): the distribution is
    still the target's, the tokens are not plain decoding's."""
    patch_mixed_rows("every_row_by_the_rule", monkeypatch)
    got, expected, _ = seeded_lookup_beside_model_rows(models)
    assert sum(g != e for g, e in zip(got, expected)) > 0.2 * len(got)


@pytest.mark.parametrize("mutant", ["one_draw_for_every_position", "rejected_position_drawn_again"])
def test_coupling_mutant_is_caught(models, mutant, monkeypatch):
    patch_coupling(mutant, monkeypatch)
    engine = Engine(models[0], NgramProposer(1, 3), 3, max_batch_size=BATCH, max_model_len=32)
    assert_caught(engine, models, NGRAM_SETTINGS["t0.7"], mutant)


def test_corpus_drafts_sampling_matches_target(models):
    """Corpus drafts are deterministic like lookup's; a table of every context seen (8 tokens: most
    contexts are there) drafts at most steps."""
    from speculant.proposers.corpus import CorpusTable

    gen = torch.Generator().manual_seed(0)
    corpus = [torch.randint(0, 8, (400,), generator=gen).tolist() for _ in range(4)]
    table = CorpusTable.build(corpus, models[0], min_count=1, min_share=0.0)
    engine = Engine(models[0], NgramProposer(2, 3, table), 3, max_batch_size=BATCH, max_model_len=32)
    params = SETTINGS["t1"]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(models[0].model, params, N_TOKENS))
    print(f"corpus drafts: G-test p = {p:.4f}, {engine.stats.num_draft_tokens} drafts")
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA



def test_inverse_cdf_sampler_alone_is_exact(models, monkeypatch):
    # Control for the residual mutant: the sampler it uses is itself exact on normalized input.
    import speculant.verify as verify_module

    monkeypatch.setattr(verify_module, "sample", inverse_cdf_sample)
    params = SETTINGS["t1"]
    p = g_test(sampled_joint(draft_engine(models), params, N_SAMPLES), exact_joint(models[0].model, params, N_TOKENS))
    assert p > ALPHA


def assert_caught(engine: Engine, models, params: SamplingParams, name: str) -> None:
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(models[0].model, params, N_TOKENS))
    print(f"{name}: G-test p = {p:.2e}")
    assert p < ALPHA


@pytest.mark.parametrize("mutant", VERIFIER_MUTANTS)
def test_verifier_mutant_is_caught(models, mutant, monkeypatch):
    patch_verifier(mutant, monkeypatch)
    assert_caught(draft_engine(models), models, SETTINGS["t1"], mutant)


@pytest.mark.parametrize("mutant", PROPOSER_MUTANTS)
def test_proposer_mutant_is_caught(models, mutant):
    engine = draft_engine(models, proposer_cls=PROPOSER_MUTANTS[mutant])
    assert_caught(engine, models, SETTINGS["t0.7_topk"], mutant)


def test_mixed_batch_keeps_both_guarantees(models):
    """Greedy and sampled requests share each step: greedy rows equal plain greedy decoding,
    sampled rows follow the target's distribution."""
    target = models[0]
    greedy = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    plain = Engine(target, max_batch_size=1, max_model_len=32)
    expected = plain.generate([plain.add_request(PROMPT, greedy)])[0].output_ids
    engine = draft_engine(models)
    params = SETTINGS["t1"]
    counts: Counter = Counter()
    for start in range(0, N_SAMPLES, BATCH // 2):
        sampled = [engine.add_request(PROMPT, replace(params, seed=start + i, max_tokens=N_TOKENS,
                                                      ignore_eos=True)) for i in range(BATCH // 2)]
        greedy_rows = [engine.add_request(PROMPT, greedy) for _ in range(BATCH // 2)]
        engine.generate(sampled + greedy_rows)
        assert all(s.output_ids == expected for s in greedy_rows)
        counts.update(tuple(s.output_ids) for s in sampled)
    assert g_test(counts, exact_joint(target.model, params, N_TOKENS)) > ALPHA
