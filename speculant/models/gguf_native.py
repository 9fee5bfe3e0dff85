"""A GGUF file loaded straight into the native kernels: each quantized tensor repacked exactly (models/ggml.py)
into a packed cache that later loads read into huge pages; no float copy of the model on disk or in memory.
A mixture of experts' stacked tensors (`ffn_{gate,up,down}_exps`, [experts, rows, inputs]) are repacked one expert
at a time, each its own matrix, as older Mixtral files store them (`ffn_gate.E`): a pass reads only the experts
its tokens chose (models/moe.py).

The cache holds the repacked tensors (packed.bin, packed.json) next to the config and tokenizer that
models/gguf.py writes, published by an atomic rename; the token embedding stays in the file's blocks and
only the rows a pass reads are dequantized.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from speculant.errors import SpeculantError
from speculant.models import ggml, native, notice
from speculant.models.families import BY_GGUF, BY_MODEL_TYPE, GGUF_EXPERTS
from speculant.models.gguf_file import (
    ARCHITECTURES,
    EXPERTS,
    PERMUTED_QK,
    block_names,
    cache_dir,
    cache_key,
    hf_config,
    hf_value,
    open_gguf,
    publish,
    read_metadata,
    release,
    write_generation_config,
    write_json,
    write_tokenizer,
)
from speculant.models.hugepages import start_reading
from speculant.models.kernels import PackedLinear
from speculant.models.llama import Transformer
from speculant.models.model_config import ModelConfig
from speculant.models.rope import rotary_layout, rotary_rows

FORMAT_VERSION = 5
# An embedding table up to this size is dequantized whole at load (SmolLM2-135M's: 57 MB), a larger one a
# pass's rows at a time (Qwen2.5-1.5B's would be 467 MB of bf16 beside a 1.04 GiB file).
SMALL_EMBEDDING_BYTES = 128 << 20
# The first load's repacking, bytes of the GGUF file a second: Qwen2.5-Coder-1.5B Q4_K_M's 1.04 GiB in 21 s
# (AMD EPYC Zen 5, 2026-12-02). For the first run's notice.
REPACK_BYTES_PER_S = 50e6
CHUNK_ROWS = 8192  # outputs repacked at a time: a vocabulary-sized head's temporaries stay a few hundred MB
Shapes = list[tuple[tuple[int, ...], np.dtype]]  # a matrix's 7 kernel tensors
DENSE = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


# A draft's matrices stored wider than Q4_0 may be requantized to it: a cheaper draft pass. The draft's drafts
# are only proposals, so its precision never changes the output (the target's is the file's, always).
REQUANTIZED = gguf.GGMLQuantizationType.Q4_0
WIDER = {gguf.GGMLQuantizationType[n] for n in ("Q4_1", "Q5_0", "Q5_K", "Q6_K", "Q8_0")}


def cache_folder(src: Path, requantize: bool = False) -> Path:
    return cache_dir(None) / "gguf-native" / f"{cache_key(src)}-v{FORMAT_VERSION}{'-q4_0' * requantize}"


@functools.lru_cache(maxsize=1)
def _reader(src: Path, key: str) -> gguf.GGUFReader:
    """One parse for the check and the build: GGUFReader reads every vocabulary string, seconds for 151k."""
    return open_gguf(src)


@dataclass(frozen=True)
class Matrix:
    """One matrix the kernels multiply by: a 2-D tensor of the file, or one expert of a stacked one."""
    name: str  # experts as blk.N.ffn_{gate,up,down}.E.weight, whichever way the file stores them
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (inputs, outputs), ggml's order
    data: np.ndarray  # [outputs, bytes a row]


def matrices(reader: gguf.GGUFReader) -> list[Matrix]:
    """The file's multiplied matrices: every 2-D tensor but the embedding (unless it is the head too) and a router
    (kept dense: ROUTERS), each stacked expert tensor split by expert; an MTP layer's too (Transformer.fill_mtp)."""
    tied = "output.weight" not in {t.name for t in reader.tensors}
    out = []
    for t in reader.tensors:
        if len(t.shape) == 1 or t.name == "token_embd.weight" and not tied or dense_matrix(t):
            continue
        shape = (int(t.shape[0]), int(t.shape[1]))
        if len(t.shape) == 3 and (m := EXPERTS.fullmatch(t.name)) and m[3] is None:
            out += [Matrix(f"blk.{m[1]}.ffn_{m[2]}.{e}.weight", t.tensor_type, shape, t.data[e])
                    for e in range(int(t.shape[2]))]
        elif len(t.shape) == 2:
            out.append(Matrix(t.name, t.tensor_type, shape, t.data))
        else:
            raise SpeculantError(f"tensor '{t.name}' of shape {list(t.shape)} is no matrix the decoder reads")
    return out


ROUTER = ".ffn_gate_inp."  # an MoE layer's router: its logits decide the experts, so it is never quantized
# Read as floats whatever their type: a DeltaNet's conv taps (summed tap by tap, gdn.py), its β and decay inputs
# (a row a value head) and a shared expert's gate (one row).
FLOAT_MATRICES = (".ssm_conv1d.", ".ssm_beta.", ".ssm_alpha.", ".ssm_ba.", ".ffn_gate_inp_shexp.")


def dense_matrix(t) -> bool:
    """A router stored as floats: kept in full precision beside the norms (router logits that moved would pick
    other experts)."""
    if len(t.shape) == 2 and any(k in t.name for k in FLOAT_MATRICES):
        return True
    return ROUTER in t.name and t.tensor_type in DENSE and len(t.shape) == 2


def native_loadable(src: Path) -> bool:
    """Whether every matrix of the file has a native kernel here (else the file goes through models/gguf.py)."""
    if native.level() == "off":
        return False
    if (cache_folder(src) / "packed.json").is_file():
        return True
    reader = _reader(src, cache_key(src))
    tied = "output.weight" not in {t.name for t in reader.tensors}
    for t in reader.tensors:
        if t.name == "token_embd.weight" and not tied:  # rows are looked up, not multiplied
            if t.tensor_type not in ggml.FORMATS and t.tensor_type not in DENSE:
                return False
        elif dense_matrix(t):
            continue
        elif len(t.shape) == 3 and not (EXPERTS.fullmatch(t.name) and usable(t)):
            return False
        elif len(t.shape) == 2 and not usable(t):
            return False
    arch = read_metadata(reader).get("general.architecture")
    # gpt-oss (sinks, biases, clamped experts) and Gemma 4 (per-layer embeddings, KV sharing, head sizes by layer)
    # are no form the packed model assembles yet: their float folders run.
    return arch in ARCHITECTURES and not BY_GGUF[arch].attention_sinks and not BY_GGUF[arch].value_norm


def usable(t) -> bool:
    return ggml.usable(t.tensor_type, int(t.shape[1]), int(t.shape[0]))


def load_gguf_native(src: Path, dtype: torch.dtype = torch.bfloat16, requantize: bool = False,
                     meanwhile: Callable[[Path], Any] | None = None) -> tuple[Transformer, Path, dict, Any]:
    """→ (the model, the folder with its config and tokenizer, load facts: whether the packed cache was
    there, the bytes read into huge pages, what `meanwhile(folder)` returned: work done while the weights
    are read, e.g. the tokenizer); `requantize`: the WIDER matrices as REQUANTIZED (drafts only)."""
    folder = cache_folder(src, requantize)
    cached = (folder / "packed.json").is_file()
    if not cached:
        build_cache(src, folder, requantize)
    config = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(config, source=str(src))
    packed = read_packed(folder)
    model = assemble(src, cfg, packed, dtype)
    extra = meanwhile(folder) if meanwhile else None
    packed["wait"]()
    return model, folder, {"gguf_cached": cached, "huge_pages_bytes": packed["huge"]}, extra


# --- the packed cache ---------------------------------------------------------------------------------------

def build_cache(src: Path, folder: Path, requantize: bool = False) -> None:
    notice.announce(f"repacking {src.name} for the native kernels, cached for later runs",
                    src.stat().st_size / REPACK_BYTES_PER_S)
    reader = _reader(src, cache_key(src))
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise SpeculantError(f"{src}: unsupported architecture '{arch}'. Supported: {', '.join(ARCHITECTURES)}.")
    config = hf_config(reader, meta, arch, src)

    def write(tmp: Path) -> None:
        write_packed(reader, config, arch, src, tmp, requantize)
        write_tokenizer(reader, meta, src, tmp)
        write_generation_config(meta, config, tmp)
        write_json(tmp / "config.json", config)

    publish(folder, "packed.json", write)


def stored_rows(t, rows: np.ndarray | slice, requantize: bool) -> tuple[gguf.GGMLQuantizationType, np.ndarray]:
    """(type, raw bytes) of tensor t's rows as the kernel will hold them: the file's, or requantized."""
    raw = t.data[rows]
    if not (requantize and t.tensor_type in WIDER):
        return t.tensor_type, raw
    return REQUANTIZED, gguf.quants.quantize(gguf.quants.dequantize(raw, t.tensor_type), REQUANTIZED)


def component_shapes(t, n_in: int, requantize: bool = False) -> Shapes:
    """The shapes and dtypes of ggml.layout's 7 tensors for tensor t, its outputs padded to 16: a block's
    times the blocks (1-D ones, the format and the empty tensors, as they are)."""
    blocks = (int(t.shape[1]) + 15) // 16
    return [((blocks, *shape[1:]) if len(shape) > 1 else shape, dt)
            for shape, dt in block_shapes(t.tensor_type, n_in, requantize)]


@functools.cache
def block_shapes(qtype: gguf.GGMLQuantizationType, n_in: int, requantize: bool) -> Shapes:
    """ggml.layout's tensors for one block of 16 outputs, from zero bytes: the file's pages stay untouched (an
    MoE has thousands of matrices, and each first read would stay in this process's memory)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    zeros = Matrix("", qtype, (n_in, 16), np.zeros((16, n_in // block * size), np.uint8))
    stored, raw = stored_rows(zeros, slice(0, 16), requantize)
    return [(tuple(x.shape), x.numpy().dtype) for x in ggml.layout(ggml.decode(stored, raw, 16, n_in).padded())]


def write_packed(reader: gguf.GGUFReader, config: dict, arch: str, src: Path, out: Path,
                 requantize: bool = False) -> None:
    """Every quantized matrix (the token embedding only where it is the head too), repacked CHUNK_ROWS outputs
    at a time into one file, with the norms and biases; the embedding's place in the GGUF file."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    cfg = ModelConfig.from_hf(config, source=str(src))
    qkv_rows = rotary_rows(cfg).numpy() if cfg.rotary_dim else None
    plan, offset = [], 0
    for t in matrices(reader):
        if t.tensor_type not in ggml.FORMATS:
            raise SpeculantError(f"{src}: tensor '{t.name}' has type {t.tensor_type.name}, which the native "
                                 f"kernels do not take. Supported: {', '.join(q.name for q in ggml.FORMATS)}.")
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        parts = []
        for shape, dt in component_shapes(t, n_in, requantize):
            parts.append({"shape": list(shape), "dtype": np.dtype(dt).str, "offset": offset})
            offset += int(np.prod(shape)) * np.dtype(dt).itemsize
            offset = (offset + 63) // 64 * 64
        plan.append((t, n_out, n_in, parts))
    vectors = {}
    for t in reader.tensors:  # norms, biases and routers, as float32
        if len(t.shape) == 1 or dense_matrix(t):
            shape = [int(d) for d in reversed(t.shape)]
            vectors[t.name] = {"shape": shape, "dtype": "<f4", "offset": offset}
            offset = (offset + 4 * int(np.prod(shape)) + 63) // 64 * 64
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding = {"type": embd.tensor_type.name, "rows": int(embd.shape[1]), "dim": int(embd.shape[0]),
                 "offset": int(embd.data_offset), "row_bytes": int(embd.n_bytes) // int(embd.shape[1])}
    index = {}
    # Plain writes, and the file's pages let go after each tensor: the build's memory stays a chunk's.
    with open(out / "packed.bin", "wb") as f:
        f.truncate(max(offset, 1))
        for t in reader.tensors:
            if t.name in vectors:
                f.seek(vectors[t.name]["offset"])
                f.write(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).tobytes())
        for t, n_out, n_in, parts in plan:
            kind = t.name.split(".")[-2]
            perm = unpermute_rows(n_out, heads[kind]) if arch in PERMUTED_QK and kind in heads else None
            if kind == "attn_qkv" and BY_MODEL_TYPE[cfg.model_type].fused_checkpoint:
                perm = qkv_rows
            elif kind in heads and (cfg.rotary_dim or cfg.attention_gate):
                perm = head_rows(cfg, heads[kind], gated=kind == "attn_q" and cfg.attention_gate)
            for r0 in range(0, n_out, CHUNK_ROWS):
                rows = np.arange(r0, min(n_out, r0 + CHUNK_ROWS))
                qtype, raw = stored_rows(t, rows if perm is None else perm[rows], requantize)
                tensors = ggml.layout(ggml.decode(qtype, raw, len(rows), n_in).padded())
                for p, tensor in zip(parts, tensors):
                    if tensor.numel() == 0:
                        continue
                    per_block = tensor[0].numel() * tensor.element_size() if len(p["shape"]) > 1 else 0
                    f.seek(p["offset"] + r0 // 16 * per_block)
                    f.write(tensor.contiguous().numpy().tobytes())
            index[t.name] = {"rows": n_out, "parts": parts}
            release(reader)
    write_json(out / "packed.json", {"version": FORMAT_VERSION, "tensors": index, "vectors": vectors,
                                     "embedding": embedding})


def head_rows(cfg: ModelConfig, n_heads: int, gated: bool) -> np.ndarray:
    """q's or k's rows in the order llama.Attention holds them: each head's dims in rotary_layout, and a gated q's
    per-head [query, gate] rows (as the checkpoint and llama.cpp store them) as every query, then every gate."""
    hd = cfg.head_dim
    dims = rotary_layout(hd, cfg.rotary_dim).numpy() if cfg.rotary_dim else np.arange(hd)
    stride = 2 * hd if gated else hd
    rows = [h * stride + dims for h in range(n_heads)]
    if gated:
        rows += [h * stride + hd + np.arange(hd) for h in range(n_heads)]
    return np.concatenate(rows)


def beta_alpha_rows(cfg: ModelConfig) -> np.ndarray:
    """Qwen3-Next's ssm_ba, grouped per key head ([b…, a…] each), as every b then every a (gdn.GatedDeltaNet)."""
    r = cfg.linear_v_heads // cfg.linear_k_heads
    grouped = np.arange(2 * cfg.linear_v_heads).reshape(cfg.linear_k_heads, 2, r)
    return np.concatenate((grouped[:, 0].reshape(-1), grouped[:, 1].reshape(-1)))


def unpermute_rows(n_out: int, n_heads: int) -> np.ndarray:
    """llama.cpp's Llama converter interleaves each head's q/k rows in pairs; row r of HF's order is row perm[r]."""
    return np.arange(n_out).reshape(n_heads, -1, 2).transpose(0, 2, 1).reshape(-1)


def read_packed(folder: Path) -> dict:
    """The packed tensors, being read into huge pages (a pass reads every weight once: in 4 KB pages, one page
    walk each 4 KB; mapped from disk copy-on-write where huge pages are not available): `wait` returns once
    they are there. The norms and biases, read now from the file's mapping, and where the token embedding's
    blocks lie in the GGUF file."""
    index = json.loads((folder / "packed.json").read_text())
    mapped = np.memmap(folder / "packed.bin", np.uint8, "c")
    reading = start_reading(folder / "packed.bin")
    data = mapped if reading is None else reading.region.numpy()

    def view(p: dict, of: np.ndarray = data) -> torch.Tensor:
        return torch.from_numpy(np.ndarray(p["shape"], np.dtype(p["dtype"]), of, p["offset"]))

    return {"matrices": {name: ([view(p) for p in m["parts"]], m["rows"]) for name, m in index["tensors"].items()},
            # Copied as the model is built: from the mapping, so that they need not wait for the copy.
            "vectors": {name: view(p, mapped) for name, p in index["vectors"].items()},
            "embedding": index["embedding"], "huge": 0 if reading is None else reading.region.numel(),
            "wait": (lambda: None) if reading is None else reading.wait}


# --- the model --------------------------------------------------------------------------------------------

class GGMLEmbedding(nn.Module):
    """The token embedding in the file's blocks, mapped from the GGUF file: a pass dequantizes its tokens' rows."""

    def __init__(self, src: Path, where: dict, dtype: torch.dtype):
        super().__init__()
        self.qtype, self.dtype = gguf.GGMLQuantizationType[where["type"]], dtype
        self.num_embeddings, self.embedding_dim = where["rows"], where["dim"]
        self.raw = np.memmap(src, np.uint8, "r", where["offset"], (where["rows"], where["row_bytes"]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of the vocabulary [0, {self.num_embeddings})")
        rows = gguf.quants.dequantize(np.asarray(self.raw[ids]), self.qtype).reshape(len(ids), self.embedding_dim)
        return torch.from_numpy(rows).to(self.dtype).view(*tokens.shape, self.embedding_dim)

    def table(self) -> nn.Embedding:
        """The whole table in the activations' dtype (a pass's lookups are then copies)."""
        return nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=self(torch.arange(self.num_embeddings)),
                            _freeze=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks"


def block_rows(parts: list[torch.Tensor], start: int, stop: int) -> list[torch.Tensor]:
    """Blocks of 16 outputs [start, stop) of a packed matrix (ggml.layout's per-block tensors; 1-D ones as they are)."""
    return [t[start:stop] if t.dim() > 1 else t for t in parts]


class Joined(nn.Module):
    """Products of one input side by side, as one projection's outputs (blocks and float rows together)."""

    def __init__(self, *parts: nn.Module):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x).to(x.dtype) for part in self.parts], dim=-1)


def router(weight: torch.Tensor) -> PackedLinear:
    """An MoE layer's router in the file's float32, on a row-exact kernel: a token's experts must not depend on
    the pass it rides in (PyTorch's bf16 linear rounds differently for one row and for five)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.float(), requires_grad=False)
    return PackedLinear(linear)


def attention_layer(attn: nn.Module, p: str, cfg: ModelConfig, matrices: dict, linear: Callable) -> None:
    """q, k, v (and a gated q's gate, whose rows head_rows put after the queries: llama.Attention's order)."""
    fused = p + "attn_qkv.weight" in matrices  # Phi-3: q, k, v in one tensor
    qkv = [f"{p}{name}.weight" for name in (["attn_qkv"] if fused else ["attn_q", "attn_k", "attn_v"])]
    attn.qkv_proj = linear(qkv, cfg.dim, cfg.qkv_bias and not fused, gate=cfg.attention_gate)
    attn.o_proj = linear([p + "attn_output.weight"], cfg.n_heads * cfg.head_dim)


def linear_layer(gdn: nn.Module, p: str, cfg: ModelConfig, matrices: dict, vectors: dict, linear: Callable,
                 dtype: torch.dtype) -> None:
    """A Gated DeltaNet layer: its four input projections as one (ssm_ba: b and a, beta_alpha_rows)."""
    if p + "ssm_ba.weight" in vectors:
        ba = vectors[p + "ssm_ba.weight"][torch.from_numpy(beta_alpha_rows(cfg))]
    else:
        ba = torch.cat((vectors[p + "ssm_beta.weight"], vectors[p + "ssm_alpha.weight"]))
    gdn.in_proj = Joined(linear([p + "attn_qkv.weight", p + "attn_gate.weight"], cfg.dim), router(ba))
    gdn.out_proj = linear([p + "ssm_out.weight"], cfg.linear_v_heads * cfg.linear_v_dim)
    for name, param in (("ssm_conv1d.weight", "conv1d.weight"), ("ssm_a", "A_log"), ("ssm_dt.bias", "dt_bias")):
        if p + name not in vectors:
            raise SpeculantError(f"missing tensor '{p + name}'")
        value = hf_value(p + name, vectors[p + name].float()).to(dtype)
        gdn.get_submodule(param.rpartition(".")[0]).register_parameter(
            param.rpartition(".")[2], nn.Parameter(value, requires_grad=False))


def assemble(src: Path, cfg: ModelConfig, packed: dict, dtype: torch.dtype) -> Transformer:
    matrices, vectors = packed["matrices"], packed["vectors"]
    family = BY_MODEL_TYPE[cfg.model_type]
    arch = family.gguf or next(a for a, f in GGUF_EXPERTS.items() if f is family)  # Mixtral's files say llama
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}

    def vector(name: str, kind: str = "") -> torch.Tensor:
        v = vectors[name]
        if arch in PERMUTED_QK and kind in heads:
            v = v[torch.from_numpy(unpermute_rows(len(v), heads[kind]))]
        return v.to(dtype)

    def linear(parts: list[str], n_in: int, bias: bool = False, gate: bool = False) -> ggml.GGMLLinear:
        missing = [p for p in parts if p not in matrices]
        if missing:
            raise SpeculantError(f"{src}: missing tensor '{missing[0]}'")
        b = torch.cat([vector(p.replace(".weight", ".bias"), p.split(".")[-2]) for p in parts]) if bias else None
        blocks = [matrices[p][0] for p in parts]
        if gate:  # q's rows: the queries, then the gates (head_rows); the gates follow v
            queries = cfg.n_heads * cfg.head_dim // 16
            blocks = [block_rows(blocks[0], 0, queries), *blocks[1:], block_rows(blocks[0], queries, 2 * queries)]
        return ggml.GGMLLinear(blocks, n_in, b)

    def fill(block: nn.Module, i: int) -> None:
        """Block i's products on the file's blocks, its norms as the file holds them."""
        p = f"blk.{i}."
        if cfg.linear(i):
            linear_layer(block.linear_attn, p, cfg, matrices, vectors, linear, dtype)
        else:
            attention_layer(block.self_attn, p, cfg, matrices, linear)
        mlp = block.mlp
        fused = family.fused_checkpoint  # Phi-3: gate and up in ffn_up
        if cfg.routed(i):
            mlp.gate = router(vectors[p + "ffn_gate_inp.weight"])
            for e, expert in enumerate(mlp.experts):
                expert.gate_up_proj = linear([f"{p}ffn_gate.{e}.weight", f"{p}ffn_up.{e}.weight"], cfg.dim)
                expert.down_proj = linear([f"{p}ffn_down.{e}.weight"], cfg.expert_size)
            if cfg.shared_expert_size:
                mlp.shared_expert.gate_up_proj = linear([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"],
                                                        cfg.dim)
                mlp.shared_expert.down_proj = linear([p + "ffn_down_shexp.weight"], cfg.shared_expert_size)
                mlp.shared_expert_gate = router(hf_value(p + "ffn_gate_inp_shexp.weight",
                                                         vectors[p + "ffn_gate_inp_shexp.weight"]))
        else:
            mlp.gate_up_proj = linear([p + "ffn_up.weight"] if fused else [p + "ffn_gate.weight", p + "ffn_up.weight"],
                                      cfg.dim)
            mlp.down_proj = linear([p + "ffn_down.weight"], cfg.intermediate_size)
        for name, module in block_names(arch).items():
            if name.endswith("norm") and f"{p}{name}.weight" in vectors:
                weight = vector(f"{p}{name}.weight")
                if name in ("attn_q_norm", "attn_k_norm") and cfg.rotary_dim:  # their dims follow head_rows'
                    weight = weight[rotary_layout(cfg.head_dim, cfg.rotary_dim)]
                block.get_submodule(module).weight = nn.Parameter(weight, requires_grad=False)

    with torch.device("meta"):
        model = Transformer(cfg)
    for i, block in enumerate(model.model.layers):
        fill(block, i)
    mtp = f"blk.{cfg.n_layers}."
    if cfg.mtp_layers and mtp + "nextn.eh_proj.weight" in matrices:
        def fill_mtp(head: nn.Module) -> None:
            """An MTP head (proposers/mtp.py) on the file's blocks: its layer as block n_layers, fc as eh_proj."""
            fill(head.layers[0], cfg.n_layers)
            head.fc = linear([mtp + "nextn.eh_proj.weight"], 2 * cfg.dim)

        model.fill_mtp = fill_mtp
    model.model.norm.weight = nn.Parameter(vector("output_norm.weight"), requires_grad=False)
    head, rows = matrices["output.weight" if "output.weight" in matrices else "token_embd.weight"]
    model.lm_head = ggml.GGMLLinear([head], cfg.dim, out_features=rows)
    embed = GGMLEmbedding(src, packed["embedding"], dtype)
    if embed.num_embeddings * embed.embedding_dim * 2 <= SMALL_EMBEDDING_BYTES:
        embed = embed.table()
    model.model.embed_tokens = embed
    model.set_rope_frequencies()
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise SpeculantError(f"{src}: no weights for {', '.join(left[:3])}")
    return model.eval().requires_grad_(False)
