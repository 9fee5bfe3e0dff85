"""Turn a llama.cpp GGUF file into a Hugging Face style folder, so the rest of speculant loads one format.

Weights are dequantized to float32 with the `gguf` package and renamed to Hugging Face parameter names
(gguf_file.py); for llama/mistral files the q/k row permutation llama.cpp applies is undone. The result is cached
under `<cache>/gguf/<key>` and published by an atomic rename.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import torch
from safetensors.torch import save_file

from speculant.errors import SpeculantError
from speculant.models import notice
from speculant.models.families import BY_GGUF
from speculant.models.gguf_file import (
    ARCHITECTURES,
    EXPERTS,
    PERMUTED_QK,
    cache_dir,
    cache_key,
    can_dequantize,
    dequantize,
    hf_config,
    hf_name,
    hf_value,
    named_tensors,
    open_gguf,
    publish,
    read_metadata,
    release,
    write_generation_config,
    write_json,
    write_tokenizer,
)

SHARD_BYTES = 2 << 30  # a conversion's float32 tensors held at once before they are written


# Every block must have these, and the dense MLP's three or a router; q/k norms and biases are optional.
REQUIRED_BLOCK = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm"]


DENSE_MLP = ["ffn_gate", "ffn_up", "ffn_down"]


# A family whose checkpoints fuse q, k, v and gate, up (Phi-3): llama.cpp keeps them fused.
FUSED_BLOCK = ["attn_qkv", "attn_output", "attn_norm", "ffn_norm"]


FUSED_MLP = ["ffn_up", "ffn_down"]
# A hybrid model's Gated DeltaNet and attention layers (the MLP's input norm is post_attention_norm).
HYBRID_LINEAR = ["attn_qkv", "attn_gate", "ssm_conv1d", "ssm_norm", "ssm_out", "attn_norm", "post_attention_norm"]
HYBRID_ATTENTION = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "post_attention_norm"]


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


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stores each head's rows as interleaved pairs (h, d/2, 2); HF's rotate-half wants (h, 2, d/2).
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensors(reader: gguf.GGUFReader, config: dict, arch: str, src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under Hugging Face's names, streamed (float_tensors), after checking every name."""
    names = {t.name for t in reader.tensors}
    for i in range(config["num_hidden_layers"]):
        routed = f"blk.{i}.ffn_gate_inp.weight" in names
        for part in required_tensors(config, arch, i) + ([] if routed else dense_mlp(arch)):
            if f"blk.{i}.{part}.weight" not in names:
                raise SpeculantError(f"{src}: missing tensor 'blk.{i}.{part}.weight'.")
    if "output_norm.weight" not in names:
        raise SpeculantError(f"{src}: missing tensor 'output_norm.weight'.")
    for t in reader.tensors:
        if (EXPERTS.fullmatch(t.name) or ".ffn_gate_inp." in t.name) and not config.get("num_experts"):
            raise SpeculantError(f"{src}: tensor '{t.name}' has no equivalent in a dense model (the file states "
                                 f"no {arch}.expert_count).")
        if not EXPERTS.fullmatch(t.name):
            # Raises on a tensor no model has: before the slow part.
            hf_name(t.name, src, arch, config["num_hidden_layers"])
    return float_tensors(reader, config, arch, src)


def required_tensors(config: dict, arch: str, layer: int) -> list[str]:
    if BY_GGUF[arch].gguf_block:
        return list(BY_GGUF[arch].gguf_block)
    if BY_GGUF[arch].linear_attention:
        return HYBRID_LINEAR if config["layer_types"][layer] == "linear_attention" else HYBRID_ATTENTION
    return FUSED_BLOCK if BY_GGUF[arch].fused_checkpoint else REQUIRED_BLOCK


def dense_mlp(arch: str) -> list[str]:
    return FUSED_MLP if BY_GGUF[arch].fused_checkpoint else DENSE_MLP


def float_tensors(reader: gguf.GGUFReader, config: dict, arch: str, src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor), one tensor (or one expert) at a time; a file's MTP layer is read
    where it drafts (proposers/mtp.py)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, t, expert in named_tensors(reader, config, arch, src):
        if name.startswith("mtp."):
            continue
        w = hf_value(t.name, dequantize(t, expert))
        kind = t.name.split(".")[-2]
        if arch in PERMUTED_QK and kind in heads:
            w = unpermute(w, heads[kind])
        yield name, w
