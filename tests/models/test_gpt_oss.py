"""gpt-oss against transformers: a sink logit per head in attention's softmax, YaRN RoPE (untruncated, as its
checkpoints say), biases on q/k/v/o, the router and the experts, the clamped SwiGLU with gate and up
interleaved, sliding and full layers alternating; from its folder and from GGUF files written as llama.cpp's
converter writes them (gate and up split, the experts stacked, `attn_sinks`, YaRN as rope.scaling keys), with
the experts F32 or MXFP4. Speculation, batches and prefix-cache hits keep the output."""

from __future__ import annotations

import gguf
import numpy as np
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
from test_gguf import VOCAB, close, writer_for
from test_prefix_cache import BUDGET, check_turns, engine_on

from speculant.config import SamplingParams
from speculant.models import attention
from speculant.models.gguf_native import native_loadable
from speculant.models.loader import load_model

TOL = 1e-4
WINDOW = 6
Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 33, 8, 60, 12, 99, 140, 7, 23, 81, 64], [40, 41, 42, 40, 41, 42, 40, 41, 42],
           [90, 3, 77, 21, 14, 9, 55, 31, 62, 250]]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
             initializer_range=0.1, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             swiglu_limit=0.3)  # a limit the tiny activations reach, so the clamps are exercised
IDS = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))


def tiny_gpt_oss(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**SHAPE, **overrides})).eval()
    with torch.no_grad():  # zero-initialised in transformers: random ones make each rule visible
        for name, p in model.named_parameters():
            if "sinks" in name or "bias" in name:
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    tiny_gpt_oss(0).save_pretrained(root / "target")
    tiny_gpt_oss(1, num_hidden_layers=2).save_pretrained(root / "draft")
    # llama.cpp fixes the clamp at 7 (no GGUF key states it): the GGUF tests' model has that limit.
    tiny_gpt_oss(2, swiglu_limit=7.0).save_pretrained(root / "gguf")
    return {"target": root / "target", "draft": root / "draft", "gguf": root / "gguf"}


def test_config(folders):
    cfg = load_model(folders["target"]).model.cfg
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.window(0) == WINDOW
    assert cfg.attention_sinks and cfg.o_bias and cfg.router_bias and cfg.mlp_bias
    assert cfg.rope_scaling["rope_type"] == "yarn" and not cfg.rope_scaling["truncate"]
    assert np.isclose(cfg.rope_scale, 0.1 * np.log(32) + 1)


MUTANTS = ["no_sinks", "yarn_truncated", "no_attention_factor", "unclamped", "window_off"]


@pytest.mark.parametrize("mutant", [None, *MUTANTS])
def test_folder_matches_transformers(folders, monkeypatch, mutant):
    """Logits within 1e-4 (after a rollback too); each rule broken alone is caught."""
    model = load_model(folders["target"]).model
    if mutant == "no_sinks":
        for block in model.model.layers:
            block.self_attn.sinks.data.fill_(-torch.inf)  # e^-inf: a softmax without the sink
    elif mutant == "yarn_truncated":
        model.cfg.rope_scaling = {**model.cfg.rope_scaling, "truncate": True}
        model.set_rope_frequencies()
    elif mutant == "no_attention_factor":
        model.rope.scale = 1.0
    elif mutant == "unclamped":
        for block in model.model.layers:
            for expert in block.mlp.experts:
                expert.limit = float("inf")
    elif mutant == "window_off":
        model.cfg.sliding_window = None
    err = (rollback_logits(model, IDS) - reference_rollback_logits(folders["target"], IDS)).abs().max().item()
    assert err > 10 * TOL if mutant else err <= TOL


def test_sink_attention_is_transformers_eager():
    """attention.sink_attention against transformers' eager gpt-oss attention on the same tensors, with a mask."""
    from transformers.models.gpt_oss import modeling_gpt_oss as ref

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 16, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    mask = torch.zeros(2, 1, 5, 5).masked_fill_(torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    expected = ref.eager_attention_forward(module, q, k, v, mask, scaling=0.25)[0]
    got = attention.sink_attention(q, k, v, mask, enable_gqa=True, scale=0.25, sinks=sinks).transpose(1, 2)
    assert torch.allclose(got, expected, atol=1e-6)


def run_all(target, draft) -> dict[str, list[list[int]]]:
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    drafted = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    tree = {**drafted, "tree_width": 3}
    return {"batch": greedy_tokens(target, PROMPTS, max_batch_size=3),
            "ngram": greedy_tokens(target, PROMPTS, ngram, max_batch_size=3),
            "draft": greedy_tokens(target, PROMPTS, drafted, max_batch_size=3),
            "tree": greedy_tokens(target, PROMPTS[:1], tree)}


def test_greedy_and_speculation_equal_transformers(folders):
    ref = reference_model(folders["target"])
    expected = [reference_greedy_tokens(ref, p) for p in PROMPTS]
    target = load_model(folders["target"])
    assert greedy_tokens(target, PROMPTS[:1]) == expected[:1]
    for name, got in run_all(target, folders["draft"]).items():
        assert got == (expected[:1] if name == "tree" else expected), name


def test_prefix_cache_hit_and_chunked_prefill_equal_cold(folders):
    target = load_model(folders["target"])
    check_turns(target, engine_on(target, BUDGET, chunk=5), SamplingParams(temperature=0, max_tokens=16,
                                                                          ignore_eos=True))


# --- GGUF ---------------------------------------------------------------------------------------------------

def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The checkpoint under llama.cpp's names and layout: gate and up split from their interleaved columns,
    every expert matrix [out, in] and stacked, the sinks as attn_sinks.weight."""
    out = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight,
           "output.weight": model.lm_head.weight}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
    for i, layer in enumerate(model.model.layers):
        p = f"blk.{i}."
        for module, name in names.items():
            m = layer.get_submodule(module)
            out[f"{p}{name}.weight"] = m.weight
            if getattr(m, "bias", None) is not None:
                out[f"{p}{name}.bias"] = m.bias
        out[p + "attn_sinks.weight"] = layer.self_attn.sinks
        e = layer.mlp.experts
        gate_up = e.gate_up_proj.transpose(1, 2)  # [E, 2I, D]
        out[p + "ffn_gate_exps.weight"], out[p + "ffn_up_exps.weight"] = gate_up[:, 0::2], gate_up[:, 1::2]
        out[p + "ffn_gate_exps.bias"], out[p + "ffn_up_exps.bias"] = e.gate_up_proj_bias[:, 0::2], \
            e.gate_up_proj_bias[:, 1::2]
        out[p + "ffn_down_exps.weight"], out[p + "ffn_down_exps.bias"] = e.down_proj.transpose(1, 2), e.down_proj_bias
    return {k: np.ascontiguousarray(v.detach().float().numpy()) for k, v in out.items()}


def mxfp4_round_trip(model) -> None:
    """The experts' weights replaced by their MXFP4 values (E2M1, one E8M0 scale per 32 inputs, llama.cpp's
    blocks), in place: the folder saved after it is what an MXFP4 file holds exactly."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(layer.mlp.experts, name)
                rows = w.transpose(1, 2).contiguous().numpy()  # [E, out, in]: blocks along the inputs
                flat = rows.reshape(-1, rows.shape[-1])
                back = gguf.quants.dequantize(gguf.quants.quantize(flat, Q.MXFP4), Q.MXFP4).reshape(rows.shape)
                w.copy_(torch.from_numpy(back).transpose(1, 2))


def write_gpt_oss_gguf(path, model, experts: Q = Q.F32):
    cfg = model.config
    rope = cfg.rope_parameters
    writer = writer_for(path, "gpt-oss", cfg, rope["rope_theta"])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for name, w in gguf_tensors(model).items():
        if name.endswith("_exps.weight") and experts == Q.MXFP4:
            blocks = gguf.quants.quantize(w.reshape(-1, w.shape[-1]), Q.MXFP4)
            assert np.array_equal(gguf.quants.dequantize(blocks, Q.MXFP4), w.reshape(-1, w.shape[-1]))  # exact
            writer.add_tensor(name, blocks.reshape(*w.shape[:2], -1), raw_dtype=Q.MXFP4)
        else:
            writer.add_tensor(name, w)
    close(writer)
    return path


@pytest.mark.parametrize("experts", [pytest.param(Q.F32, marks=pytest.mark.slow), Q.MXFP4])
def test_gguf_matches_transformers(folders, tmp_path, monkeypatch, experts):
    """The file's converted folder (the MXFP4 experts dequantized to float32 at load): logits within 1e-4 of
    transformers on the folder the file was written from, greedy tokens equal, speculation equal."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    model = reference_model(folders["gguf"])
    if experts == Q.MXFP4:
        mxfp4_round_trip(model)
        model.save_pretrained(tmp_path / "mxfp4-values")
        folder = tmp_path / "mxfp4-values"
    else:
        folder = folders["gguf"]
    path = write_gpt_oss_gguf(tmp_path / f"tiny-gpt-oss-{experts.name}.gguf", model, experts)
    assert not native_loadable(path)  # its float folder runs (gguf_native.native_loadable)
    target = load_model(path)
    assert target.model.cfg.rope_scaling["rope_type"] == "yarn" and target.model.cfg.window(0) == WINDOW
    err = (rollback_logits(target.model, IDS) - reference_rollback_logits(folder, IDS)).abs().max().item()
    assert err <= TOL
    ref = reference_model(folder)
    expected = [reference_greedy_tokens(ref, p) for p in PROMPTS]
    assert greedy_tokens(target, PROMPTS, max_batch_size=3) == expected
    if experts == Q.F32:  # the slow suite: speculation on the file's model too
        ngram = {"method": "ngram", "num_speculative_tokens": 4}
        assert greedy_tokens(target, PROMPTS, ngram, max_batch_size=3) == expected
