"""Gemma 4 (text) against transformers: norms scaling by w with q/k norms and a weightless v norm, unscaled scores,
sliding layers beside global ones with their own head size and proportional RoPE, per-layer embeddings (their
projection, norm, gate and `layer_scalar`), KV sharing (the last layers read the keys of the last earlier layer of
their type and keep none of their own), attention_k_eq_v, final-logit soft-capping; from a Gemma4ForCausalLM
folder. Every speculation path equals plain decoding with KV sharing on."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    greedy_tokens,
    reference_greedy_tokens,
    reference_model,
    reference_rollback_logits,
    rollback_logits,
    transformers,
)
from test_prefix_cache import BUDGET, check_turns, engine_on

from speculant.config import SamplingParams
from speculant.models import model_config
from speculant.models.gguf_native import native_loadable
from speculant.models.loader import load_model

TOL = 1e-4
WINDOW = 6
VOCAB = 300
SLIDING, FULL = model_config.SLIDING, model_config.FULL
PROMPTS = [[5, 17, 33, 8, 60, 12, 99, 140, 7, 23, 81, 64], [40, 41, 42, 40, 41, 42, 40, 41, 42],
           [90, 3, 77, 21, 14, 9, 55, 31, 62, 250]]
# Six layers, sliding and global alternating; the last two KV-shared (layer 4 reads layer 2's keys, layer 5 layer 3's);
# global heads twice as wide as sliding ones.
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=WINDOW,
             hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
             layer_types=[SLIDING, FULL] * 3, final_logit_softcapping=30.0, initializer_range=0.1,
             max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
IDS = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def save_gemma4(path, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**SHAPE, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # ones in transformers: random scales catch a norm read with an offset, or skipped
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:  # the router's scales too
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.1 * i)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {"target": save_gemma4(root / "target"),
            "draft": save_gemma4(root / "draft", seed=1, num_hidden_layers=2, num_kv_shared_layers=0,
                                 layer_types=[SLIDING, FULL]),
            # The 26B-A4B's form: routed experts beside each MLP, k = v on the global layers with one KV head there.
            "moe": save_gemma4(root / "moe", seed=2, attention_k_eq_v=True, num_global_key_value_heads=1,
                               enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                               hidden_size_per_layer_input=0, num_kv_shared_layers=0)}


def test_config_and_cache_hold_only_the_unshared_layers(folders):
    model = load_model(folders["target"]).model
    cfg = model.cfg
    assert cfg.kv_source == (0, 1, 2, 3, 2, 3) and cfg.cache_layers == [0, 1, 2, 3]
    assert cfg.layer_head_dims == (32, 64) * 3 and cfg.query_scale == 1.0 and cfg.norm_offset == 0.0
    assert [model.model.layers[i].self_attn.kv_layer for i in range(6)] == [0, 1, 2, 3, 2, 3]
    cache = model.new_cache(2, 32)
    assert cache.k.shape == (4, 2, 2, 33, 64)  # four layers keep keys, as wide as the global heads


@pytest.mark.parametrize("folder", ["target", "moe"])
def test_logits_match_transformers(folders, folder):
    got = rollback_logits(load_model(folders[folder]).model, IDS)
    err = (got - reference_rollback_logits(folders[folder], IDS)).abs().max().item()
    assert err <= TOL


@pytest.mark.slow
def test_moe_variant_greedy_equals_transformers(folders):
    """The 26B-A4B's form: greedy by prompt lookup in a batch of 3 equals transformers' generate."""
    ref = reference_model(folders["moe"])
    target = load_model(folders["moe"])
    assert target.model.cfg.layer_kv_heads == (2, 1) * 3 and target.model.cfg.moe_beside_mlp
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert greedy_tokens(target, PROMPTS, ngram, max_batch_size=3, n_tokens=16) == \
        [reference_greedy_tokens(ref, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("mutant", ["router_reads_normed", "no_expert_scale"])
def test_each_moe_rule_is_needed(folders, monkeypatch, mutant):
    """The router reads the layer's input before the experts' norm, and each weight is times its expert's scale."""
    model = load_model(folders["moe"]).model
    for layer in model.model.layers:
        if mutant == "router_reads_normed":
            moe = layer.moe
            monkeypatch.setattr(moe, "forward", lambda x, routed_by=None, f=moe.forward: f(x))
        else:
            layer.moe.per_expert_scale.data.fill_(1.0)
    err = (rollback_logits(model, IDS) - reference_rollback_logits(folders["moe"], IDS)).abs().max().item()
    assert err > 10 * TOL


@pytest.mark.parametrize("mutant", ["wrong_source", "own_cache", "no_layer_scalar", "no_value_norm",
                                    "no_per_layer_inputs"])
def test_each_gemma4_rule_is_needed(folders, monkeypatch, mutant):
    """Each rule broken alone is caught: a shared layer reading another layer's keys (the first of its type) moves
    the logits; one given a cache of its own (its source's keys copied in, rows the rest of the stack never reads)
    is caught by the cache's size, which the check above pins to the unshared layers."""
    if mutant == "own_cache":
        monkeypatch.setattr(model_config.ModelConfig, "cache_layers",
                            property(lambda self: [i for i in range(self.n_layers) if not self.linear(i)]))
        model = load_model(folders["target"]).model
        assert model.new_cache(2, 32).k.shape[0] != 4
        return
    model = load_model(folders["target"]).model
    if mutant == "wrong_source":
        for i in (4, 5):
            model.model.layers[i].self_attn.kv_layer = i - 4
    elif mutant == "no_layer_scalar":
        for layer in model.model.layers:
            layer.layer_scalar.fill_(1.0)
    elif mutant == "no_value_norm":
        model.cfg.value_norm = False
    elif mutant == "no_per_layer_inputs":
        model.model.embed_tokens_per_layer.weight.data.zero_()
    err = (rollback_logits(model, IDS) - reference_rollback_logits(folders["target"], IDS)).abs().max().item()
    assert err > 10 * TOL


def test_greedy_and_every_speculation_path_equal_plain(folders):
    """Plain greedy equals transformers' generate; prompt lookup, a draft model, a batch of 3, a prefix-cache hit
    and chunked prefill (check_turns: chunks of 5) equal plain decoding, with KV sharing on."""
    ref = reference_model(folders["target"])
    expected = [reference_greedy_tokens(ref, p, 16) for p in PROMPTS]
    target = load_model(folders["target"])
    plain = [greedy_tokens(target, [p], n_tokens=16)[0] for p in PROMPTS]
    assert plain == expected
    assert greedy_tokens(target, PROMPTS, max_batch_size=3, n_tokens=16) == expected
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert greedy_tokens(target, PROMPTS, ngram, max_batch_size=3, n_tokens=16) == expected
    draft = {"method": "draft_model", "model": str(folders["draft"]), "num_speculative_tokens": 3}
    assert greedy_tokens(target, PROMPTS, draft, max_batch_size=3, n_tokens=16) == expected
    check_turns(target, engine_on(target, BUDGET, chunk=5), GREEDY)


# --- GGUF ---------------------------------------------------------------------------------------------------

def write_gemma4_gguf(path, folder):
    """The folder as llama.cpp's converter writes a `gemma4` file: its names, norms as they are (no offset), both
    head sizes, the layer pattern, KV sharing, the per-layer embeddings' width, and rope_freqs marking the global
    layers' unrotated angles (1e30)."""
    import gguf
    import numpy as np
    from test_gguf import close, writer_for

    model = reference_model(folder)
    cfg = model.config
    cfg.allow_global_per_layer_attribute_access = True  # the sliding layers' head size and KV heads, as the converter
    full = cfg.rope_parameters[FULL]
    writer = writer_for(path, "gemma4", cfg, full["rope_theta"])
    global_dim = cfg.per_layer_config[1].head_dim
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(cfg.head_dim)
    writer.add_value_length_swa(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern([t == SLIDING for t in cfg.layer_types])
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    writer.add_float32("gemma4.rope.freq_base_swa", cfg.rope_parameters[SLIDING]["rope_theta"])
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    rotated = int(global_dim * full["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (global_dim // 2 - rotated),
                                                    np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name if gguf_name.endswith(".weight") else gguf_name + ".weight",
                          np.ascontiguousarray(tensor.float().numpy()))
    close(writer)
    return path


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    """The target's shape with test_gguf's byte tokenizer (a GGUF file carries its vocabulary)."""
    from test_gguf import VOCAB as GGUF_VOCAB

    root = tmp_path_factory.mktemp("gemma4_gguf")
    return save_gemma4(root / "hf", seed=4, vocab_size=GGUF_VOCAB, vocab_size_per_layer_input=GGUF_VOCAB)


def test_gguf_matches_transformers(gguf_folder, tmp_path, monkeypatch):
    """A `gemma4` file (F32) read into its float32 folder: logits within 1e-4 of transformers on the folder it was
    written from, with KV sharing and per-layer embeddings; greedy by prompt lookup in a batch equals transformers."""
    from test_gguf import VOCAB as GGUF_VOCAB

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = write_gemma4_gguf(tmp_path / "tiny-gemma4.gguf", gguf_folder)
    assert not native_loadable(path)  # its float folder runs (gguf_native.native_loadable)
    target = load_model(path)
    cfg = target.model.cfg
    assert cfg.kv_source == (0, 1, 2, 3, 2, 3) and cfg.layer_head_dims == (32, 64) * 3 and cfg.ple_dim == 16
    ids = IDS % GGUF_VOCAB
    err = (rollback_logits(target.model, ids) - reference_rollback_logits(gguf_folder, ids)).abs().max().item()
    assert err <= TOL
    ref = reference_model(gguf_folder)
    prompts = [[t % GGUF_VOCAB for t in p] for p in PROMPTS]
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert greedy_tokens(target, prompts, ngram, max_batch_size=3, n_tokens=16) == \
        [reference_greedy_tokens(ref, p, 16) for p in prompts]


def test_bfloat16_batches_and_speculation_equal_plain(tmp_path):
    """bf16 on the native attention kernel (head sizes 64 and 128), KV sharing on: a batch of 3 and prompt lookup
    give each prompt its plain tokens."""
    target = load_model(save_gemma4(tmp_path / "wide", head_dim=64, global_head_dim=128), dtype="bfloat16")
    plain = [greedy_tokens(target, [p], n_tokens=16)[0] for p in PROMPTS]
    assert greedy_tokens(target, PROMPTS, max_batch_size=3, n_tokens=16) == plain
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert greedy_tokens(target, PROMPTS, ngram, max_batch_size=3, n_tokens=16) == plain
