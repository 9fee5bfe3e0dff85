"""What a llama.cpp GGUF file says, read alike by both loaders (gguf.py: a float32 folder; gguf_native.py: the file's
own blocks): its metadata as a Hugging Face config, its tensor names as Hugging Face's, its tokenizer rebuilt by
transformers, and the cache folders both publish into (keyed on the file's path, size and mtime, published by an
atomic rename).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from speculant.errors import SpeculantError
from speculant.models.families import BY_GGUF, GGUF_EXPERTS

ARCHITECTURES = {name: f.architectures[0] for name, f in BY_GGUF.items()}


# llama.cpp's Llama converter interleaves q/k rows for its RoPE kernel; the Qwen converters do not.
PERMUTED_QK = {name for name, f in BY_GGUF.items() if f.permuted_qk}


# Bump when the converted output changes, so stale cache entries are not reused.
FORMAT_VERSION = 3


TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             # Gemma 4's per-layer embeddings
             "per_layer_token_embd": "model.embed_tokens_per_layer",
             "per_layer_model_proj": "model.per_layer_model_projection",
             "per_layer_proj_norm": "model.per_layer_projection_norm"}


BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
}


# An MoE layer's experts, stacked [n_expert, rows, cols] (llama.cpp's layout), or one tensor each
# (blk.N.ffn_gate.E.weight, older Mixtral files): each expert becomes its own mlp.experts.E.
EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_exps|\.(\d+))\.(weight|bias)")


def block_names(arch: str) -> dict[str, str]:
    """A family's GGUF block tensor → Hugging Face module, under model.layers.N."""
    return BLOCK_NAMES | BY_GGUF[arch].gguf_names


# Soft caps (Gemma 2): Hugging Face's config keys, and the GGUF's `{arch}.` keys alike.
SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


# LongRoPE's per-frequency factors (Phi-3.5, Phi-4-mini): read into config["rope_scaling"].
ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


def publish(folder: Path, marker: str, write) -> None:
    """write(tmp) builds the folder's contents in a temporary folder beside it (same filesystem), then an
    atomic rename publishes it: only complete folders ever have the final name; a crash leaves `.tmp-*`."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(".tmp-*"):  # left by killed builds; a live one is never a day old
        if time.time() - stale.stat().st_mtime > 86400:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        write(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / marker).is_file():
                raise
            # Another process finished the same build first; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_dir(cache_root: Path | None) -> Path:
    root = cache_root or os.environ.get("SPECULANT_CACHE") or Path.home() / ".cache" / "speculant"
    return Path(root).expanduser()


def cache_key(src: Path) -> str:
    st = src.stat()
    ident = f"{FORMAT_VERSION}|{src}|{st.st_size}|{st.st_mtime_ns}"
    return f"{src.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def open_gguf(src: Path) -> gguf.GGUFReader:
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SpeculantError(f"{src}: not a GGUF file (bad magic bytes).")
    try:
        return gguf.GGUFReader(src)
    except Exception as e:  # the reader fails in many ways on a damaged file; all mean the same to the user
        raise SpeculantError(f"{src}: unreadable GGUF file (truncated or corrupt?): {e}") from None


def release(reader: gguf.GGUFReader) -> None:
    """Unmap the pages of the file read so far (they stay in the page cache, outside this process's memory)."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def write_generation_config(meta: dict, config: dict, out: Path) -> None:
    eos = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    eos = list(dict.fromkeys(eos))  # chat models stop on end-of-turn as well as end-of-sequence
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    write_json(out / "generation_config.json", gen)


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """Scalar and string fields; arrays (vocabulary, merges) are left out and read where needed."""
    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            part = field.parts[field.data[0]]
            is_str = field.types[0] == gguf.GGUFValueType.STRING
            meta[key] = bytes(part).decode("utf-8") if is_str else part.tolist()[0]
    return meta


def token_text(reader: gguf.GGUFReader, token_id: int | None) -> str | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if token_id is None or field is None or not 0 <= token_id < len(field.data):
        return None
    return bytes(field.parts[field.data[token_id]]).decode("utf-8")


def require(meta: dict, key: str, src: Path):
    if key not in meta:
        raise SpeculantError(f"{src}: missing required metadata key '{key}'.")
    return meta[key]


def hf_config(reader: gguf.GGUFReader, meta: dict, arch: str, src: Path) -> dict:
    def req(key: str):
        return require(meta, f"{arch}.{key}", src)

    hidden, n_heads = req("embedding_length"), req("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // n_heads
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))  # llama.cpp's default when absent
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise SpeculantError(f"{src}: missing tensor 'token_embd.weight'.")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embd.shape[1]),  # the weights are the truth; metadata vocab_size is optional
        "hidden_size": hidden,
        # One per layer in a Gemma 4 file whose shared layers' MLPs are twice as wide (gemma4_config).
        "intermediate_size": (array_field(reader, f"{arch}.feed_forward_length") or [None])[0]
        or req("feed_forward_length"),
        # The MTP layers a file carries (`nextn`) are blocks after the decoder's own.
        "num_hidden_layers": req("block_count") - meta.get(f"{arch}.nextn_predict_layers", 0),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": req("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "max_position_embeddings": req("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary and rotary != head_dim:  # Phi-4-mini rotates 3/4 of each head
        config["partial_rotary_factor"] = rotary / head_dim
    family = BY_GGUF[arch]
    if meta.get(f"{arch}.expert_count"):
        family = GGUF_EXPERTS.get(arch, family)
        config.update(expert_config(meta, arch, config, names), architectures=[family.architectures[0]],
                      model_type=family.model_type)
    if family.linear_attention:
        config.update(hybrid_config(reader, meta, arch, config, family))
    config.update(family.gguf_defaults)
    if family.window_by_default:  # HF's Mistral defaults to a 4096 window; only use one the file states
        config["sliding_window"] = meta.get(f"{arch}.attention.sliding_window", config.get("sliding_window"))
    for cap in SOFT_CAPS:  # where llama.cpp caps the family: the file's value, else its default (gguf_defaults)
        if cap in config:
            config[cap] = float(meta.get(f"{arch}.{cap}", config[cap]))
    if family.norm_offset:  # llama.cpp's converter added it to the norms already (model_config.ModelConfig reads this)
        config["norm_weights_include_offset"] = True
    if family.gguf_width_scaled_layers:  # llama.cpp scales the 27B's scores by its width per head, not head_dim
        wide = config["num_hidden_layers"] == family.gguf_width_scaled_layers
        config["query_pre_attn_scalar"] = hidden // n_heads if wide else head_dim
    if family.value_norm:  # Gemma 4: its rope_freqs mark the unrotated angles of its global layers
        config.update(gemma4_config(reader, meta, arch, config))
        return config
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    factors = {ROPE_FACTORS[t.name]: dequantize(t).flatten().tolist() for t in reader.tensors
               if t.name in ROPE_FACTORS}
    if factors:
        config["rope_scaling"] = longrope_scaling(factors, meta, arch, src)
        config["original_max_position_embeddings"] = config["rope_scaling"]["original_max_position_embeddings"]
    elif freqs is not None:
        scaling = llama3_scaling(dequantize(freqs).numpy(), rope_theta, head_dim)
        if scaling is not None:
            config["rope_scaling"] = scaling
    elif meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        config["rope_scaling"] = {"rope_type": meta[f"{arch}.rope.scaling.type"],
                                  "factor": float(req("rope.scaling.factor"))}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            orig = meta[f"{arch}.rope.scaling.original_context_length"]
            config["rope_scaling"]["original_max_position_embeddings"] = orig
        config["rope_scaling"].update(family.gguf_rope_scaling)
    return config


def array_field(reader: gguf.GGUFReader, key: str) -> list | None:
    field = reader.fields.get(key)
    if field is None or field.types[0] != gguf.GGUFValueType.ARRAY:
        return None
    return [field.parts[i].tolist()[0] for i in field.data]


def gemma4_config(reader: gguf.GGUFReader, meta: dict, arch: str, config: dict) -> dict:
    """A Gemma 4 file's shape under transformers' names, as llama.cpp's converter writes it: the global layers' head
    size (key_length) beside the sliding ones' (key_length_swa), the layer types (sliding_window_pattern), KV heads
    and MLP widths per layer where they differ, KV sharing, the per-layer embeddings' width, and proportional RoPE
    (rope_freqs: 1 for a rotated angle, 1e30 for one that stays)."""
    n = config["num_hidden_layers"]
    swa = array_field(reader, f"{arch}.attention.sliding_window_pattern") or [False] * n
    types = ["sliding_attention" if s else "full_attention" for s in swa[:n]]
    global_dim = config["head_dim"]
    head_dim = meta.get(f"{arch}.attention.key_length_swa", global_dim)
    out = {"layer_types": types, "head_dim": head_dim, "global_head_dim": global_dim,
           "num_kv_shared_layers": meta.get(f"{arch}.attention.shared_kv_layers", 0),
           "hidden_size_per_layer_input": meta.get(f"{arch}.embedding_length_per_layer_input", 0)}
    names = {t.name for t in reader.tensors}
    unshared = range(n - out["num_kv_shared_layers"])
    # k = v: a global layer with keys of its own and no value projection.
    out["attention_k_eq_v"] = any(types[i] == "full_attention" and f"blk.{i}.attn_k.weight" in names
                                  and f"blk.{i}.attn_v.weight" not in names for i in unshared)
    kv = array_field(reader, f"{arch}.attention.head_count_kv")
    if kv:  # one per layer: the sliding layers' count, and the global layers' (which transformers reads with k = v)
        out["num_key_value_heads"] = next(h for h, t in zip(kv, types) if t == "sliding_attention")
        out["num_global_key_value_heads"] = next(h for h, t in zip(kv, types) if t == "full_attention")
    ff = array_field(reader, f"{arch}.feed_forward_length")
    if ff:  # twice as wide on the KV-shared layers
        out["intermediate_size"], out["use_double_wide_mlp"] = ff[0], len(set(ff)) > 1
    if out["hidden_size_per_layer_input"]:
        embd = next(t for t in reader.tensors if t.name == "per_layer_token_embd.weight")
        out["vocab_size_per_layer_input"] = int(embd.shape[1])
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rotated = int((dequantize(freqs) < 1e29).sum()) if freqs is not None else global_dim // 2
    out["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base_swa",
                                                                                    10000.0))},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / global_dim,
                           "rope_theta": config["rope_theta"]}}
    if f"{arch}.final_logit_softcapping" in meta:
        out["final_logit_softcapping"] = float(meta[f"{arch}.final_logit_softcapping"])
    return out


def expert_config(meta: dict, arch: str, config: dict, names: set[str]) -> dict:
    """A GGUF's experts as Hugging Face's config names them (Qwen3-MoE's keys; Mixtral reads the count from
    num_local_experts). Layers without a router keep a dense MLP."""
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return {"num_experts": meta[f"{arch}.expert_count"], "num_local_experts": meta[f"{arch}.expert_count"],
            "num_experts_per_tok": meta[f"{arch}.expert_used_count"],
            "moe_intermediate_size": meta.get(f"{arch}.expert_feed_forward_length", config["intermediate_size"]),
            # llama.cpp renormalises the chosen experts' weights unless the file says not to.
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
            "decoder_sparse_step": 1, "mlp_only_layers": dense,
            "shared_expert_intermediate_size": meta.get(f"{arch}.expert_shared_feed_forward_length", 0)}


def hybrid_config(reader: gguf.GGUFReader, meta: dict, arch: str, config: dict, family) -> dict:
    """A hybrid file's Gated DeltaNet shape under Hugging Face's names (llama.cpp's `ssm.*` keys), its layer types
    (recurrent_layers, else every `full_attention_interval`-th layer attends), and its MTP layer count."""
    n, v_heads = config["num_hidden_layers"], meta[f"{arch}.ssm.time_step_rank"]
    field = reader.fields.get(f"{arch}.attention.recurrent_layers")
    recurrent = [bool(field.parts[i][0]) for i in field.data] if field is not None else None
    if recurrent is None:
        every = meta.get(f"{arch}.full_attention_interval", 4)
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    k_heads = meta[f"{arch}.ssm.group_count"]
    return {"layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n]],
            "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
            "linear_key_head_dim": meta[f"{arch}.ssm.state_size"],
            "linear_value_head_dim": meta[f"{arch}.ssm.inner_size"] // v_heads,
            "linear_conv_kernel_dim": meta[f"{arch}.ssm.conv_kernel"],
            "linear_value_heads_tiled": family.gguf_tiled_value_heads and k_heads != v_heads,
            "mtp_num_hidden_layers": meta.get(f"{arch}.nextn_predict_layers", 0)}


def longrope_scaling(factors: dict[str, list[float]], meta: dict, arch: str, src: Path) -> dict:
    """Hugging Face's `longrope` rope_scaling from llama.cpp's factor tensors and the pretrained context."""
    if set(factors) != set(ROPE_FACTORS.values()):
        raise SpeculantError(f"{src}: LongRoPE needs both rope_factors_short and rope_factors_long tensors")
    original = require(meta, f"{arch}.rope.scaling.original_context_length", src)
    return {"type": "longrope", "short_factor": factors["short_factor"], "long_factor": factors["long_factor"],
            "original_max_position_embeddings": original}


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency divisors (`rope_freqs.weight`).

    llama.cpp stores Llama 3.x scaling only as these divisors. Between the two cut-offs the blend weight is
    linear in 1/wavelength; with low_freq_factor = 1 (as Meta's configs have) the line gives
    high_freq_factor and the original context length, which reproduce the same frequencies exactly.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1:
        return None
    mid = (factors > 1 + 1e-4) & (factors < factor - 1e-4)
    high, orig = 4.0, 8192  # Meta's published values: the fallback when too few frequencies are blended
    if mid.sum() >= 2:
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[mid], smooth, 1)
        high = round(float(1 - 1 / intercept), 4)
        orig = int(round(slope * (high - 1)))
    return {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": 1.0,
            "high_freq_factor": high, "original_max_position_embeddings": orig}


@functools.cache
def can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    # Probe gguf's dequantizer with one zero block: accept whatever the installed version supports.
    if qtype not in gguf.GGML_QUANT_SIZES:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        return True
    except Exception:
        return False


def dequantize(t, expert: int | None = None) -> torch.Tensor:
    """Tensor t as float32 in PyTorch's order; `expert`: that expert's matrix of a stacked tensor alone."""
    values = gguf.quants.dequantize(t.data if expert is None else t.data[expert], t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims fastest-first, torch slowest-first
    shape = shape if expert is None else shape[1:]
    # F32 tensors come back as a read-only view of the memory-mapped file; copy those only.
    return torch.from_numpy(np.require(values.reshape(shape), np.float32, ["C", "W"]))


# Gated DeltaNet parameters whose GGUF names are no module's weight or bias.
LINEAR_PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
                 "attn_sinks.weight": "self_attn.sinks",  # and gpt-oss's sink logits, Gemma 4's layer scalar
                 "layer_output_scale.weight": "layer_scalar"}
# An MTP layer's own tensors (`blk.L.nextn.*`, L the decoder's layer count), beside an ordinary block.
NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "shared_head_norm": "norm"}


def hf_name(name: str, src: Path, arch: str = "llama", n_layers: int | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor; blocks from `n_layers` on are MTP layers (`mtp.*`)."""
    if name == "rope_freqs.weight" or name in ROPE_FACTORS:
        return None  # folded into config["rope_scaling"]
    if m := re.fullmatch(r"blk\.(\d+)\.(.+)", name):
        i, rest = int(m[1]), m[2]
        mtp = n_layers is not None and i >= n_layers
        prefix = f"mtp.layers.{i - n_layers}." if mtp else f"model.layers.{i}."
        base, _, kind = rest.rpartition(".")
        names = block_names(arch)
        if mtp and base.startswith("nextn.") and base[6:] in NEXTN:
            return f"mtp.{NEXTN[base[6:]]}.{kind}"
        if rest in LINEAR_PARAMS:
            return prefix + LINEAR_PARAMS[rest]
        if kind in ("weight", "bias") and base in names:
            return f"{prefix}{names[base]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{kind}"
    raise SpeculantError(f"{src}: tensor '{name}' has no equivalent in a Llama-family model "
                         "(multimodal GGUFs are not supported).")


def named_tensors(reader: gguf.GGUFReader, config: dict, arch: str, src: Path) -> Iterator[tuple[str, Any, int | None]]:
    """(Hugging Face name, the file's tensor, the expert of a stacked tensor or None) for every tensor a model
    reads: experts one each, MTP blocks under mtp.*."""
    n = config["num_hidden_layers"]
    for t in reader.tensors:
        if m := EXPERTS.fullmatch(t.name):
            i = int(m[1])
            prefix = f"mtp.layers.{i - n}." if i >= n else f"model.layers.{i}."
            for e in range(int(t.shape[-1])) if m[3] is None else [int(m[3])]:  # ggml's last dim: the expert
                yield f"{prefix}mlp.experts.{e}.{m[2]}_proj.{m[4]}", t, e if m[3] is None else None
        elif (name := hf_name(t.name, src, arch, n)) is not None:
            yield name, t, None


def mtp_state(src: Path) -> dict[str, torch.Tensor]:
    """A GGUF file's MTP layer (`nextn_predict_layers`; the target's own file or an MTP-only file beside it) as
    float32 tensors under the checkpoint's mtp.* names, its norms as stored (1 + w: the config says so)."""
    reader = open_gguf(src)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in BY_GGUF:
        raise SpeculantError(f"{src}: unsupported architecture '{arch}'.")
    config = hf_config(reader, meta, arch, src)
    tensors = named_tensors(reader, config, arch, src)
    return {name: hf_value(t.name, dequantize(t, expert)) for name, t, expert in tensors if name.startswith("mtp.")}

def hf_value(name: str, w: torch.Tensor) -> torch.Tensor:
    """A GGUF tensor's values as the Hugging Face parameter holds them, where llama.cpp's converter changed them
    (beyond norms' 1 + w, which the config states: norm_weights_include_offset)."""
    if name.endswith(".ssm_a"):  # stored as −exp(A_log)
        return (-w).log()
    if name.endswith(".ssm_conv1d.weight"):  # squeezed from [channels, 1, kernel]
        return w.unsqueeze(1)
    if name.endswith(".ffn_gate_inp_shexp.weight"):  # one output row, which llama-quantize squeezes away
        return w.reshape(1, -1)
    return w


def write_tokenizer(reader: gguf.GGUFReader, meta: dict, src: Path, out: Path) -> None:
    try:  # transformers is the reference tokenizer; rebuilding its pipelines by hand would drift from it
        from transformers import AutoTokenizer
    except ImportError:  # an optional dependency (the `peers` extra)
        msg = "Converting a GGUF tokenizer needs transformers (pip install transformers)."
        raise SpeculantError(msg) from None
    # Load from a folder holding only the GGUF, so a tokenizer.json lying next to the user's file is ignored.
    scratch = out / ".src"
    scratch.mkdir()
    try:
        (scratch / src.name).symlink_to(src.resolve())
    except OSError:  # no symlinks on this system: fall back to the file's own folder
        scratch.rmdir()
        scratch = src.parent
    stand_in = BY_GGUF.get(meta.get("general.architecture"))
    if stand_in is not None and stand_in.gguf_tokenizer_as:
        reader = under_architecture(reader, stand_in.gguf_tokenizer_as)
    try:
        with reader_reused(reader, src):
            tok = AutoTokenizer.from_pretrained(str(scratch), gguf_file=src.name, local_files_only=True)
    except Exception as e:
        raise SpeculantError(f"{src}: cannot build its tokenizer: {e}") from None
    finally:
        if scratch != src.parent:
            shutil.rmtree(scratch)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the generic class: tokenizer.json is complete
        "bos_token": token_text(reader, meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token": token_text(reader, meta.get("tokenizer.ggml.eos_token_id")),
        "unk_token": token_text(reader, meta.get("tokenizer.ggml.unknown_token_id")),
        "pad_token": token_text(reader, meta.get("tokenizer.ggml.padding_token_id")),
        "add_bos_token": bool(getattr(tok, "add_bos_token", meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    write_json(out / "tokenizer_config.json", tok_config)


def under_architecture(reader: gguf.GGUFReader, arch: str) -> gguf.GGUFReader:
    """The parsed file as if its general.architecture were `arch`: for transformers' tokenizer reader, which
    refuses architectures it has no model for though the tokenizer fields are the same."""
    text = arch.encode()
    key = b"general.architecture"
    field = gguf.gguf_reader.ReaderField(
        0, key.decode(), [np.array([len(key)], np.uint64), np.frombuffer(key, np.uint8),
                          np.array([gguf.GGUFValueType.STRING], np.uint32), np.array([len(text)], np.uint64),
                          np.frombuffer(text, np.uint8)], [4], [gguf.GGUFValueType.STRING])
    stand_in = copy.copy(reader)
    stand_in.fields = {**reader.fields, key.decode(): field}
    return stand_in


@contextlib.contextmanager
def reader_reused(reader: gguf.GGUFReader, src: Path) -> Iterator[None]:
    """transformers' converter parses the file again with gguf.GGUFReader (seconds for a 151k vocabulary):
    while it runs, a GGUFReader of `src` is the one already parsed. Other files parse as usual."""
    original = gguf.GGUFReader

    def parsed(path, *args, **kwargs):
        if Path(path).resolve() == src.resolve():
            return reader
        return original(path, *args, **kwargs)

    gguf.GGUFReader = parsed
    try:
        yield
    finally:
        gguf.GGUFReader = original


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

