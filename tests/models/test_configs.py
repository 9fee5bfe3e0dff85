"""Configs as their publishers write them: every key a config.json leaves out takes the default of the family's own
transformers config class, never Llama's. Each published config (and each with any one key dropped) gives the
ModelConfig that transformers' config class and rotary embedding resolve, field by field."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch
from conftest import transformers
from published_configs import PUBLISHED

from speculant.errors import SpeculantError
from speculant.models import families
from speculant.models.model_config import FULL, SLIDING, ModelConfig
from speculant.models.rope import rope_inv_freq

REQUIRED = {"hidden_size", "num_hidden_layers", "intermediate_size"}
ROTARY = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3",
          "qwen3_moe": "Qwen3Moe", "phi3": "Phi3", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}


def transformers_config(raw: dict):
    """transformers' own reading of a config.json (the text model's, for a multimodal one)."""
    kwargs = {k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"}
    return transformers.AutoConfig.for_model(raw["model_type"], **kwargs).get_text_config()


def expected_fields(c) -> dict:
    """What transformers' config `c` says, in ModelConfig's fields."""
    rope = c.rope_parameters
    per_type = FULL in rope
    full = rope[FULL] if per_type else rope
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary = int(head_dim * full.get("partial_rotary_factor", 1.0))
    types = getattr(c, "layer_types", None)
    scalar = getattr(c, "query_pre_attn_scalar", None)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0)
    window = getattr(c, "sliding_window", None)
    return dict(
        vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads, head_dim=head_dim, intermediate_size=c.intermediate_size,
        norm_eps=c.rms_norm_eps, rope_theta=full["rope_theta"],
        local_rope_theta=rope[SLIDING]["rope_theta"] if per_type else None,
        # LongRoPE is served up to the pretrained context (model_config.longrope).
        max_position_embeddings=c.original_max_position_embeddings if full["rope_type"] == "longrope"
        else c.max_position_embeddings,
        tie_embeddings=c.tie_word_embeddings, sliding_window=window,
        layer_types=tuple(types) if window and types and SLIDING in types else None,
        query_scale=None if scalar is None or scalar == head_dim else scalar ** -0.5,
        rotary_dim=None if rotary == head_dim else rotary,
        attn_softcap=getattr(c, "attn_logit_softcapping", None),
        logit_softcap=getattr(c, "final_logit_softcapping", None),
        n_experts=experts, experts_per_token=c.num_experts_per_tok if experts else 0,
        expert_size=getattr(c, "moe_intermediate_size", c.intermediate_size) if experts else 0,
    )


def expected_rotary(c) -> dict[str, tuple[torch.Tensor, float]]:
    """Each layer kind's (inverse frequencies, cos/sin scale) from transformers' own rotary embedding."""
    name = c.model_type.removesuffix("_text")
    cls = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"),
                  f"{ROTARY[c.model_type]}RotaryEmbedding")
    rotary = cls(c)
    if FULL in c.rope_parameters:
        return {kind: (getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling"))
                for kind in (FULL, SLIDING)}
    return {FULL: (rotary.inv_freq, rotary.attention_scaling)}


def assert_fields_equal(got: dict, expected: dict) -> None:
    """Floats within a relative 1e-6 (a config's float round-trips through JSON), every other field exactly."""
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        if isinstance(want, float) and not isinstance(got[name], bool):
            assert got[name] == pytest.approx(want, rel=1e-6), name
        else:
            assert got[name] == want, name


def assert_same_as_transformers(raw: dict) -> None:
    c = transformers_config(raw)
    cfg = ModelConfig.from_hf(copy.deepcopy(raw))
    assert_fields_equal({name: getattr(cfg, name) for name in expected_fields(c)}, expected_fields(c))
    for kind, (inv_freq, scale) in expected_rotary(c).items():
        ours = rope_inv_freq(cfg, kind)
        torch.testing.assert_close(ours[:len(inv_freq)], inv_freq.float(), rtol=1e-6, atol=0)
        assert not ours[len(inv_freq):].any()  # dims that do not rotate
        assert (cfg.rope_scale if kind == FULL else 1.0) == pytest.approx(scale)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_is_read_as_transformers_reads_it(name):
    assert_same_as_transformers(PUBLISHED[name])


def test_gemma3_4b_text_config_gets_gemma3s_defaults():
    """The facts the sparse 4B text_config leaves to Gemma3TextConfig (Llama's defaults refused the config, and
    with vocab_size and num_attention_heads added, gave a base of 10,000, 8 KV heads and a head size of 320)."""
    cfg = ModelConfig.from_hf(copy.deepcopy(PUBLISHED["gemma-3-4b-it"]))
    assert (cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (262208, 8, 4, 256)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_scale) == (1e6, 1e4, None)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}  # the global layers' alone
    assert [cfg.kind(i) for i in range(6)] == [SLIDING] * 5 + [FULL] and cfg.window(0) == 1024
    assert ModelConfig.from_hf(copy.deepcopy(PUBLISHED["gemma-3-27b-it"])).query_scale == 168 ** -0.5


def one_key_dropped(name: str):
    raw = PUBLISHED[name]
    text = raw.get("text_config", raw)
    for key in sorted(set(text) - REQUIRED - {"architectures", "model_type"}):
        dropped = copy.deepcopy(raw)
        dropped.get("text_config", dropped).pop(key)
        yield key, dropped


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_each_key_left_out_takes_the_familys_own_default(name):
    """Any one key dropped: the family's config class fills it, or refuses the config as transformers does."""
    for key, raw in one_key_dropped(name):
        try:
            transformers_config(raw)
        except Exception:
            with pytest.raises(SpeculantError, match="refuses it"):
                ModelConfig.from_hf(raw)
            continue
        assert_same_as_transformers(raw), key


def test_llamas_defaults_for_gemma3_are_caught(monkeypatch):
    """Mutant: Gemma 3 filled from LlamaConfig's defaults reads the 4B wrong, and the comparison sees it."""
    gemma3 = families.BY_ARCHITECTURE["Gemma3ForConditionalGeneration"]
    monkeypatch.setitem(families.BY_ARCHITECTURE, "Gemma3ForConditionalGeneration",
                        dataclasses.replace(gemma3, config_class="LlamaConfig"))
    with pytest.raises(AssertionError):
        assert_same_as_transformers(PUBLISHED["gemma-3-4b-it"])


def test_missing_size_and_refused_values_are_one_line_errors():
    raw = copy.deepcopy(PUBLISHED["Phi-4-mini-instruct"])
    raw.pop("hidden_size")
    with pytest.raises(SpeculantError, match=r"config.json: missing required key\(s\): hidden_size"):
        ModelConfig.from_hf(raw)
    raw = copy.deepcopy(PUBLISHED["Phi-4-mini-instruct"])
    raw["rope_scaling"]["short_factor"] = [1.0] * 47  # 48 rotated pairs
    with pytest.raises(SpeculantError, match="Phi3Config refuses it: .*short_factor field must have length 48"):
        ModelConfig.from_hf(raw)


def test_reading_a_config_leaves_it_as_it_was():
    """transformers' config classes rewrite the rope dicts they are given: the caller's stay untouched."""
    raw = copy.deepcopy(PUBLISHED["gemma-3-4b-it"])
    ModelConfig.from_hf(raw)
    assert raw == PUBLISHED["gemma-3-4b-it"]


def test_resolved_configs_are_kept_on_disk_and_read_back_the_same(tmp_path, monkeypatch):
    """A load reads the family's defaults from the disk cache (transformers' import costs a second); what it
    reads back gives the same ModelConfig as transformers' own resolution."""
    from speculant.models import model_config

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    fresh = {name: ModelConfig.from_hf(copy.deepcopy(raw)) for name, raw in PUBLISHED.items()}
    assert len(list((tmp_path / "configs").iterdir())) == len(PUBLISHED)

    def no_transformers(*args):
        raise AssertionError("resolved again")

    monkeypatch.setattr(model_config, "resolve_with_transformers", no_transformers)
    for name, raw in PUBLISHED.items():
        assert ModelConfig.from_hf(copy.deepcopy(raw)) == fresh[name], name
    changed = copy.deepcopy(PUBLISHED["gemma-3-4b-it"])
    changed["text_config"]["num_hidden_layers"] = 2  # another config: not the kept one
    with pytest.raises(AssertionError, match="resolved again"):
        ModelConfig.from_hf(changed)


def test_field_comparison_is_exact_but_for_floats():
    """The comparison itself: a float within 1e-6 passes, a float, a tuple or an int off by one entry fails."""
    want = {"norm_eps": 1e-6, "layer_types": ("sliding_attention", "full_attention"), "n_layers": 2}
    assert_fields_equal(dict(want, norm_eps=1e-6 * (1 + 1e-9)), want)
    for wrong in ({"norm_eps": 1e-5}, {"layer_types": ("sliding_attention",) * 2}, {"n_layers": 3}):
        with pytest.raises(AssertionError):
            assert_fields_equal(dict(want, **wrong), want)
