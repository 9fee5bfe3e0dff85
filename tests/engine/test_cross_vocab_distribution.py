"""Sampled drafts of another vocabulary by TLI follow the target's distribution exactly: the joint of the first
three tokens, sampled N_SAMPLES times (fixed seeds), passes test_distribution's G-test at ALPHA; both mutants
fail it.

The pair: 8-token models (heads of 32, which the native attention kernel takes: the row-by-row path would
cost minutes here), under byte-level tokenizers that share six tokens (two of them at other ids) and differ in
two, on which the draft puts a sixth of its mass: renormalised away."""

from __future__ import annotations

import pytest
from conftest import save_tiny
from mutants import CROSS_VOCAB_MUTANTS
from test_distribution import ALPHA, BATCH, N_SAMPLES, N_TOKENS, SETTINGS, exact_joint, g_test, sampled_joint
from vocab_pairs import bpe, save_tokenizer

from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers.cross_vocab import CrossVocabProposer
from speculant.proposers.vocab_map import build_vocab_map

pytestmark = pytest.mark.usefixtures("rule_path")

TARGET = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5, "Ġ": 6, "ab": 7}
DRAFT = {"<unk>": 0, "<s>": 1, "</s>": 2, "b": 3, "a": 4, "d": 5, "Ġ": 6, "ba": 7}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_small")
    common = dict(vocab_size=8, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  init_std=0.15)
    target = save_tokenizer(save_tiny(root / "target", seed=3, num_hidden_layers=2, **common),
                            bpe(TARGET, [("a", "b")]))
    draft = save_tokenizer(save_tiny(root / "draft", seed=4, num_hidden_layers=1, **common), bpe(DRAFT, [("b", "a")]))
    return load_model(target), load_model(draft)


def engine(models, cls=CrossVocabProposer) -> Engine:
    target, draft = models
    vmap = build_vocab_map(target.tokenizer.hf, draft.tokenizer.hf, 8, 8)
    assert vmap.mapping() == "tli" and vmap.shared == 6
    return Engine(target, cls(draft, target, vmap, BATCH, 64), 2, max_batch_size=BATCH, max_model_len=32)


# The mutants fail by a wide margin (p below 1e-100 at N_SAMPLES): a fifth of the samples shows them.
MUTANT_SAMPLES = N_SAMPLES // 5


@pytest.mark.parametrize("setting", ["t1"])
def test_tli_sampling_matches_target(models, setting):
    params = SETTINGS[setting]
    e = engine(models)
    p = g_test(sampled_joint(e, params, N_SAMPLES), exact_joint(models[0].model, params, N_TOKENS))
    print(f"{setting}: G-test p = {p:.4f}")
    assert e.stats.num_accepted_tokens > 0
    assert p > ALPHA


@pytest.mark.parametrize("mutant", list(CROSS_VOCAB_MUTANTS))
def test_tli_mutants_are_caught(models, mutant):
    params = SETTINGS["t1"]
    p = g_test(sampled_joint(engine(models, CROSS_VOCAB_MUTANTS[mutant]), params, MUTANT_SAMPLES),
               exact_joint(models[0].model, params, N_TOKENS))
    print(f"{mutant}: G-test p = {p:.2e}")
    assert p < ALPHA
