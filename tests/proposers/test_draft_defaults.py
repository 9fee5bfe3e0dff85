"""What a user gets by naming a draft alone, or a named model with a sibling: the measured drafting rules;
and the checks on a draft that cannot pay."""

from __future__ import annotations

import pytest

from speculant.arguments import speculative_config_from_args
from speculant.cli import build_parser
from speculant.defaults import DRAFT_K, DRAFT_RULES, default_speculative_config
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.models.registry import MODELS, is_installed
from speculant.proposers.draft_model import check_vocab, warn_if_not_cheaper


def config(*flags):
    return speculative_config_from_args(build_parser().parse_args(["generate", "hi", *flags]))


def test_draft_model_alone_gets_the_measured_rules():
    assert config("--draft-model", "small.gguf").draft_quantization == "q4_0"
    cfg = config("--draft-model", "some/draft")
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "some/draft", DRAFT_K)
    assert cfg.draft_quantization is None  # a folder's weights are not GGUF blocks
    assert (cfg.lookup_first, cfg.draft_p_chain, cfg.draft_vocab_size) == \
        (DRAFT_RULES["lookup_first"], DRAFT_RULES["draft_p_chain"], DRAFT_RULES["draft_vocab_size"])
    cfg = config("--draft-model", "d", "--draft-p-chain", "0", "--draft-vocab-size", "0", "-k", "6")
    assert (cfg.draft_p_chain, cfg.draft_vocab_size, cfg.num_speculative_tokens) == (0, 0, 6)
    assert config("--draft-model", "d", "--draft-p-min", "0.6").draft_p_min == 0.6
    # The vLLM-shaped JSON config means what it says: no rule it does not name.
    cfg = config("--speculative-config", '{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}')
    assert (cfg.lookup_first, cfg.draft_p_min, cfg.draft_vocab_size) == (False, 0.0, 0)
    with pytest.raises(SpeculantError, match="--draft-p-chain and --draft-vocab-size shape a draft model.s drafts"):
        config("--ngram", "--draft-p-min", "0.5")
    with pytest.raises(SpeculantError, match=r"draft_p_min=1.5 is out of range \[0, 1\)"):
        config("--draft-model", "d", "--draft-p-min", "1.5")


def test_a_fixed_k_only_where_the_verify_pass_is_flat_and_chains_everywhere(monkeypatch):
    from speculant.defaults import FLAT_VERIFY_LEVELS
    from speculant.models import native

    for level in native.LEVELS:
        monkeypatch.setattr(native, "level", lambda level=level: level)
        # Where the verify pass is flat a sequence alone drafts k; a batch's pass is compute-bound everywhere.
        assert config("--draft-model", "d").adaptive == ("batched" if level in FLAT_VERIFY_LEVELS else True), level
        assert config("--draft-model", "d", "--adaptive").adaptive is True
        # A chain at every level; a tree where its width is given.
        assert config("--draft-model", "d").tree_width == 1
        assert config("--draft-model", "d", "--tree-width", "3").tree_width == 3


def test_a_named_model_with_a_sibling_drafts_with_it_by_default():
    cfg = default_speculative_config("qwen2.5-coder-1.5b-instruct")
    assert cfg["method"] == "draft_model" and cfg["model"] == "qwen2.5-coder-0.5b-instruct"
    assert {k: cfg[k] for k in DRAFT_RULES} == DRAFT_RULES
    assert cfg["draft_quantization"] == "q4_0"  # a GGUF draft: its wider matrices as Q4_0
    assert default_speculative_config("qwen2.5-coder-0.5b-instruct") is None  # the family's smallest
    assert config("--model", "qwen2.5-coder-1.5b-instruct").model == "qwen2.5-coder-0.5b-instruct"
    assert config("--model", "qwen2.5-coder-1.5b-instruct", "--no-speculation") is None


def test_a_draft_larger_than_its_target_is_warned_about(tiny_pair):
    target, draft = load_model(tiny_pair[0]), load_model(tiny_pair[1])
    assert warn_if_not_cheaper(target, draft) is None
    with pytest.warns(UserWarning, match=r"the draft model \(\d+M parameters\) is not smaller than the target"):
        warn_if_not_cheaper(draft, target)


def test_the_bundled_model_drafts_for_the_qwen_target_across_vocabularies(smollm_path):
    name = "qwen2.5-coder-0.5b-instruct"
    if not is_installed(MODELS[name]):
        pytest.skip(f"{name} is not in the cache: speculant models --fetch {name}")
    qwen = load_model(name, dtype="auto", quantization="auto")
    assert check_vocab(qwen, load_model(smollm_path, dtype="auto", quantization="auto")) is False
