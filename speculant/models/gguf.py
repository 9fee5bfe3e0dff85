"""Turn a llama.cpp GGUF file into a Hugging Face style folder, so the rest of speculant loads one format.

Weights are dequantized to float32 with the `gguf` package and renamed to Hugging Face parameter names;
for llama/mistral files the q/k row permutation llama.cpp applies is undone. The tokenizer is rebuilt by
transformers' own GGUF converter (the reference we must match id for id). The result is cached under
`<cache>/gguf/<key>`, keyed on the file's path, size and mtime, and published by an atomic rename.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from speculant.errors import SpeculantError
from speculant.models import notice
from speculant.models.families import BY_GGUF, GGUF_EXPERTS

ARCHITECTURES = {name: f.architectures[0] for name, f in BY_GGUF.items()}
# llama.cpp's Llama converter interleaves q/k rows for its RoPE kernel; the Qwen converters do not.
PERMUTED_QK = {name for name, f in BY_GGUF.items() if f.permuted_qk}
# Bump when the converted output changes, so stale cache entries are not reused.
FORMAT_VERSION = 2
SHARD_BYTES = 2 << 30  # a conversion's float32 tensors held at once before they are written

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
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
EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_exps|\.(\d+))\.weight")


def block_names(arch: str) -> dict[str, str]:
    """A family's GGUF block tensor → Hugging Face module, under model.layers.N."""
    return BLOCK_NAMES | BY_GGUF[arch].gguf_names


# Every block must have these, and the dense MLP's three or a router; q/k norms and biases are optional.
REQUIRED_BLOCK = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm"]
DENSE_MLP = ["ffn_gate", "ffn_up", "ffn_down"]
# A family whose checkpoints fuse q, k, v and gate, up (Phi-3): llama.cpp keeps them fused.
FUSED_BLOCK = ["attn_qkv", "attn_output", "attn_norm", "ffn_norm"]
FUSED_MLP = ["ffn_up", "ffn_down"]
# Soft caps (Gemma 2): Hugging Face's config keys, and the GGUF's `{arch}.` keys alike.
SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")
# LongRoPE's per-frequency factors (Phi-3.5, Phi-4-mini): read into config["rope_scaling"].
ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


def convert_gguf(path: str | os.PathLike, cache_root: Path | None = None) -> tuple[Path, bool]:
    """Convert a GGUF file (Llama-family: general.architecture llama / mistral / qwen2 / qwen3) into a
    Hugging Face style folder, cached; return (folder, was_cached)."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise SpeculantError(f"GGUF file not found: {src}")
    src = src.resolve()
    folder = cache_dir(cache_root) / "gguf" / cache_key(src)
    if (folder / "config.json").is_file():  # only complete folders ever get this name (atomic rename)
        return folder, True

    # 1.04 GiB took 211 s (AMD EPYC Zen 5, 2026-12-02): about 5 MB of the file a second.
    notice.announce(f"converting {src.name} to a float32 model folder, one tensor at a time, cached for later runs",
                    src.stat().st_size / 5e6)
    reader = open_gguf(src)
    publish(folder, "config.json", lambda tmp: write_folder(reader, src, tmp))
    return folder, False


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


def stored_bits(src: Path, folder: Path) -> float:
    """Bits per weight the file's 2-D (layer) tensors are stored with, weighted by size: what
    `--quantization auto` matches. Read once (seconds: every tensor's header) and kept in `folder`,
    the file's converted copy."""
    kept = folder / "gguf_stored_bits.json"
    if kept.exists():
        return json.loads(kept.read_text())["bits_per_weight"]
    bits = _stored_bits(open_gguf(src))
    tmp = kept.with_suffix(".tmp")
    write_json(tmp, {"bits_per_weight": bits})
    tmp.replace(kept)
    return bits


def _stored_bits(reader: gguf.GGUFReader) -> float:
    total = bits = 0
    for t in reader.tensors:
        if len(t.shape) >= 2 and t.tensor_type in gguf.GGML_QUANT_SIZES:  # experts' stacks too
            block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
            total += int(t.n_elements)
            bits += int(t.n_elements) * 8 * nbytes / block
    return bits / total if total else 32.0


def write_folder(reader: gguf.GGUFReader, src: Path, out: Path) -> None:
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch is None:
        raise SpeculantError(f"{src}: missing required metadata key 'general.architecture'.")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise SpeculantError(f"{src}: unsupported architecture '{arch}'. Supported: {supported}.")
    # Check everything that can fail cheaply before the slow dequantization.
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if key not in reader.fields:
            raise SpeculantError(f"{src}: missing required metadata key '{key}'.")
    for t in reader.tensors:
        if not can_dequantize(t.tensor_type):
            supported = ", ".join(q.name for q in gguf.GGMLQuantizationType if can_dequantize(q))
            raise SpeculantError(f"{src}: tensor '{t.name}' has unsupported type {t.tensor_type.name}. "
                                 f"Supported: {supported}.")
    config = hf_config(reader, meta, arch, src)
    write_shards(hf_tensors(reader, config, arch, src), out, lambda: release(reader))
    write_tokenizer(reader, meta, src, out)
    write_generation_config(meta, config, out)
    write_json(out / "config.json", config)


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, release: Callable[[], None]) -> None:
    """The tensors as they come, in shards of SHARD_BYTES (one model.safetensors where they all fit): memory holds
    one shard, never the whole float32 model (a 1.6 GiB MoE file is over 12 GiB of float32)."""
    shards, shard, size = [], {}, 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            shards.append(shard_name := f"model-{len(shards) + 1:05d}.safetensors")
            save_file(shard, str(out / shard_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, shard_name))
            release()
        shard, size = {}, 0

    weight_map: dict[str, str] = {}
    for name, tensor in tensors:
        if shard and size + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name], size = tensor, size + tensor.nbytes
    if not shards:  # it all fits: the single file every small model has
        save_file(shard, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    flush()
    write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


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


# --- metadata ------------------------------------------------------------------------------------------

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
        "intermediate_size": req("feed_forward_length"),
        "num_hidden_layers": req("block_count"),
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
    return config


def expert_config(meta: dict, arch: str, config: dict, names: set[str]) -> dict:
    """A GGUF's experts as Hugging Face's config names them (Qwen3-MoE's keys; Mixtral reads the count from
    num_local_experts). Layers without a router keep a dense MLP."""
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return {"num_experts": meta[f"{arch}.expert_count"], "num_local_experts": meta[f"{arch}.expert_count"],
            "num_experts_per_tok": meta[f"{arch}.expert_used_count"],
            "moe_intermediate_size": meta.get(f"{arch}.expert_feed_forward_length", config["intermediate_size"]),
            # llama.cpp renormalises the chosen experts' weights unless the file says not to.
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
            "decoder_sparse_step": 1, "mlp_only_layers": dense}


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


# --- weights -------------------------------------------------------------------------------------------

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


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stores each head's rows as interleaved pairs (h, d/2, 2); HF's rotate-half wants (h, 2, d/2).
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(name: str, src: Path, arch: str = "llama") -> str | None:
    if name == "rope_freqs.weight" or name in ROPE_FACTORS:
        return None  # folded into config["rope_scaling"]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    names = block_names(arch)
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
    base, _, kind = name.rpartition(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{kind}"
    raise SpeculantError(f"{src}: tensor '{name}' has no equivalent in a Llama-family model "
                         "(multimodal GGUFs and shared experts are not supported).")


def hf_tensors(reader: gguf.GGUFReader, config: dict, arch: str, src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under Hugging Face's names, streamed (float_tensors), after checking every name."""
    names = {t.name for t in reader.tensors}
    fused = BY_GGUF[arch].fused_checkpoint
    required, dense = (FUSED_BLOCK, FUSED_MLP) if fused else (REQUIRED_BLOCK, DENSE_MLP)
    for i in range(config["num_hidden_layers"]):
        routed = f"blk.{i}.ffn_gate_inp.weight" in names
        for part in required + ([] if routed else dense):
            if f"blk.{i}.{part}.weight" not in names:
                raise SpeculantError(f"{src}: missing tensor 'blk.{i}.{part}.weight'.")
    if "output_norm.weight" not in names:
        raise SpeculantError(f"{src}: missing tensor 'output_norm.weight'.")
    for t in reader.tensors:
        if (EXPERTS.fullmatch(t.name) or ".ffn_gate_inp." in t.name) and not config.get("num_experts"):
            raise SpeculantError(f"{src}: tensor '{t.name}' has no equivalent in a dense model (the file states "
                                 f"no {arch}.expert_count).")
        if not EXPERTS.fullmatch(t.name):
            hf_name(t.name, src, arch)  # raises on a tensor no model has: before the slow part
    return float_tensors(reader, config, arch, src)


def float_tensors(reader: gguf.GGUFReader, config: dict, arch: str, src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor), one tensor (or one expert) at a time."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        if m := EXPERTS.fullmatch(t.name):
            for e in range(int(t.shape[2])) if m[3] is None else [int(m[3])]:
                w = dequantize(t, e if m[3] is None else None)
                yield f"model.layers.{m[1]}.mlp.experts.{e}.{m[2]}_proj.weight", w
            continue
        name = hf_name(t.name, src, arch)
        if name is None:
            continue
        w = dequantize(t)
        kind = t.name.split(".")[-2]
        if arch in PERMUTED_QK and kind in heads:
            w = unpermute(w, heads[kind])
        yield name, w


# --- tokenizer -----------------------------------------------------------------------------------------

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
        (scratch / src.name).symlink_to(src)
    except OSError:  # no symlinks on this system: fall back to the file's own folder
        scratch.rmdir()
        scratch = src.parent
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
