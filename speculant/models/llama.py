"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) in plain PyTorch.

RMSNorm, RoPE, SwiGLU, grouped-query attention; optional qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3)
and routed experts in place of the MLP (Qwen3-MoE, Mixtral: moe.py). Parameter names follow Hugging Face's
so checkpoints load as they are.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.families import FAMILIES, family_of
from speculant.models.ggml import GGMLLinear
from speculant.models.kernels import PackedLinear
from speculant.models.kv_cache import CacheIndex, KVCache
from speculant.models.limits import MAX_VERIFY_WIDTH
from speculant.models.moe import MoE
from speculant.models.quantize import Int4Linear

if TYPE_CHECKING:
    from speculant.models.cuda_graphs import PassGraphs

SUPPORTED_ARCHITECTURES = {a: f.model_type for f in FAMILIES for a in f.architectures}
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scale: float = 1.0  # cos and sin multiplied by it: LongRoPE's attention factor
    rotary_dim: int | None = None  # the dims of each head that rotate (Phi-4-mini: 3/4 of them); None: all
    # What the family changes (families.Family, copied here so that a config alone builds the model).
    norm_offset: float = 0.0
    activation: str = "silu"
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    layer_types: tuple[str, ...] | None = None  # SLIDING or FULL per layer; None: every layer alike
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base, unscaled
    query_scale: float | None = None  # attention's score scale where it is not 1/√head_dim
    # Soft caps (Gemma 2): scores and final logits become cap·tanh(x / cap); None: uncapped.
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # Routed experts (moe.py): how many, how many a token runs, each one's width, the family's rule, whether
    # the top k weights are renormalised, and the layers that keep a dense MLP.
    n_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    routing: str | None = None
    renormalise: bool = True
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        if isinstance(cfg.get("text_config"), dict):  # a multimodal checkpoint: its text decoder only
            cfg = {**cfg["text_config"], "architectures": archs}
        family = family_of(archs, cfg.get("model_type"))
        if family is None:
            name = ", ".join(archs) or cfg.get("model_type") or "unknown"
            raise SpeculantError(
                f"{source}: unsupported architecture '{name}'. "
                f"Supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size"]
        missing = [k for k in required if cfg.get(k) is None]
        if missing:
            raise SpeculantError(f"{source}: missing required key(s): {', '.join(missing)}.")
        n_heads = cfg["num_attention_heads"]
        rope, local_rope = rope_parameters(cfg)
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        max_positions, rope_scale = cfg.get("max_position_embeddings", 4096), 1.0
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3", "longrope", "linear"):
                raise SpeculantError(f"{source}: unsupported rope_scaling type '{kind}' (supported: llama3, "
                                     "longrope, linear).")
            if kind == "default":
                scaling = None
            elif kind == "linear":
                scaling = {"rope_type": "linear", "factor": float(scaling["factor"])}
            elif kind == "longrope":
                scaling, max_positions, rope_scale = longrope(cfg, scaling, source)
        windowed = cfg.get("use_sliding_window", family.window_by_default)
        sliding = cfg.get("sliding_window") if windowed else None
        layer_types = cfg.get("layer_types")
        pattern = cfg.get("sliding_window_pattern") or family.sliding_pattern
        if layer_types is None and pattern and sliding:
            layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg["num_hidden_layers"])]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rotary_dim = partial_rotary_dim(cfg, rope, scaling or {}, head_dim, source)
        scalar = cfg.get("query_pre_attn_scalar")
        # GGUF folders converted by gguf.py hold Gemma's norms as llama.cpp stores them, with the 1 added.
        offset = 0.0 if cfg.get("norm_weights_include_offset") else family.norm_offset
        n_experts = (cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if family.routing else 0
        step = cfg.get("decoder_sparse_step") or 1
        dense_layers = tuple(i for i in range(cfg["num_hidden_layers"])
                             if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step)
        return cls(
            model_type=family.model_type,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            max_position_embeddings=max_positions,
            rope_scaling=scaling,
            rope_scale=rope_scale,
            rotary_dim=rotary_dim,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", family.tied_by_default)),
            qkv_bias=bool(cfg.get("attention_bias") or family.qkv_bias),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            sliding_window=sliding,
            norm_offset=offset,
            activation=family.activation,
            scale_embeddings=family.scale_embeddings,
            sandwich_norms=family.sandwich_norms,
            layer_types=tuple(layer_types) if layer_types and sliding and SLIDING in layer_types else None,
            local_rope_theta=cfg.get("rope_local_base_freq") or local_rope.get("rope_theta"),
            query_scale=None if scalar is None or scalar == head_dim else scalar ** -0.5,
            attn_softcap=cfg.get("attn_logit_softcapping"),
            logit_softcap=cfg.get("final_logit_softcapping"),
            n_experts=n_experts,
            experts_per_token=cfg.get("num_experts_per_tok", 2) if n_experts else 0,
            expert_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if n_experts else 0,
            routing=family.routing if n_experts else None,
            renormalise=bool(cfg.get("norm_topk_prob", False)),  # transformers' default
            dense_layers=dense_layers if n_experts else (),
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it sees every key)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def attention_kinds(self) -> list[str]:
        """The layers' kinds of attention (a pass prepares each once): FULL, or SLIDING where windowed."""
        if self.layer_types is None:
            return [SLIDING if self.sliding_window else FULL]
        return sorted(set(self.layer_types))

    def routed(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is routed experts (moe.py)."""
        return self.n_experts > 0 and layer not in self.dense_layers

    def kind(self, layer: int) -> str:
        return self.attention_kinds[0] if self.layer_types is None else self.layer_types[layer]


def rope_parameters(cfg: dict) -> tuple[dict, dict]:
    """(the global layers' RoPE parameters, the sliding layers') from transformers' `rope_parameters`, flat or
    one entry per layer type."""
    rope = cfg.get("rope_parameters") or {}
    if FULL in rope or SLIDING in rope:
        return rope.get(FULL) or {}, rope.get(SLIDING) or {}
    return rope, {}


def partial_rotary_dim(cfg: dict, rope: dict, scaling: dict, head_dim: int, source: str) -> int | None:
    """The dims of each head that rotate, where `partial_rotary_factor` leaves some unrotated (None: all)."""
    factor = next((c["partial_rotary_factor"] for c in (scaling, rope, cfg) if c.get("partial_rotary_factor")), 1.0)
    dim = int(head_dim * factor)
    if dim == head_dim:
        return None
    if dim <= 0 or dim % 2:
        raise SpeculantError(f"{source}: partial_rotary_factor {factor} rotates {dim} of {head_dim} dims per head; "
                             "an even number from 2 to head_dim is needed")
    return dim


def rotary_layout(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The checkpoint's dims of a head in the order they are stored here when only the first `rotary_dim` rotate:
    the rotated halves moved to the starts of the head's halves, so that dims d and d + head_dim/2 pair up as
    they do with full rotation and every rotary kernel works unchanged (the rest see an angle of 0). Queries and
    keys are permuted alike, so their dot products are the checkpoint's."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    dims = torch.arange(head_dim)
    rotated, passed = dims[:rotary_dim], dims[rotary_dim:]
    return torch.cat((rotated[:half], passed[:rest], rotated[half:], passed[rest:]))


def rotary_rows(cfg: ModelConfig) -> torch.Tensor:
    """The fused qkv projection's rows in the order they are stored here: each q and k head in rotary_layout, the
    v rows as they are. GGUF files (gguf_native) are repacked in this order, checkpoints permuted on load."""
    dims = rotary_layout(cfg.head_dim, cfg.rotary_dim)
    heads = [h * cfg.head_dim + dims for h in range(cfg.n_heads + cfg.n_kv_heads)]  # q's, then k's
    start = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
    return torch.cat([*heads, torch.arange(start, start + cfg.n_kv_heads * cfg.head_dim)])


def permute_rotary_on_load(attn: nn.Module, cfg: ModelConfig) -> None:
    """Store qkv_proj's rows in rotary_rows' order; state_dict() gives the checkpoint's order back."""

    def on_load(_module, state, prefix, *_):
        for suffix in ("weight", "bias"):
            key = f"{prefix}qkv_proj.{suffix}"
            if key in state:  # fuse_on_load ran first; the order is made here, as the model is on the meta device
                state[key] = state[key][rotary_rows(cfg).to(state[key].device)]

    def on_save(_module, state, prefix, _meta):
        rows = rotary_rows(cfg)
        q_rows, k_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for name, order in (("q_proj", rows[:q_rows]), ("k_proj", rows[q_rows:q_rows + k_rows] - q_rows)):
            for suffix in ("weight", "bias"):
                key = f"{prefix}{name}.{suffix}"
                if key in state:
                    state[key] = state[key][order.argsort().to(state[key].device)]

    attn.register_load_state_dict_pre_hook(on_load)
    attn.register_state_dict_post_hook(on_save)


def longrope(cfg: dict, scaling: dict, source: str) -> tuple[dict, int, float]:
    """Phi-3's LongRoPE → (the scaling rope_inv_freq reads, the context served, the attention factor). Served up
    to the pretrained context, with the short factors: transformers switches to the long ones only past it
    (and then for every position at once), which a KV cache written earlier cannot follow."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise SpeculantError(f"{source}: longrope needs original_max_position_embeddings")
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": list(scaling["short_factor"])}, original, attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        if offset:
            fold_offset_on_load(self, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype and native.layer_ops_usable(x):
            return native.rms_norm(x, self.weight, self.eps)
        # One call (it normalises bf16/fp16 in fp32 and rounds once): a separate upcast, cast back and
        # weight product were three more operations per norm, 61 norms per pass.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def fold_offset_on_load(norm: RMSNorm, offset: float) -> None:
    """A norm that scales by (offset + weight) holds the sum, computed in fp32 when its checkpoint loads (as
    transformers computes it in every pass): the norm then runs as any other. state_dict() gives the
    checkpoint's weight back."""

    def add(_module, state, prefix, *_):
        if prefix + "weight" in state:
            state[prefix + "weight"] = state[prefix + "weight"].float() + offset

    def subtract(_module, state, prefix, _meta):
        state[prefix + "weight"] = state[prefix + "weight"] - offset

    norm.register_load_state_dict_pre_hook(add)
    norm.register_state_dict_post_hook(subtract)


def rope_inv_freq(cfg: ModelConfig, kind: str = FULL) -> torch.Tensor:
    """The rotary frequencies of layers of `kind`: a sliding layer with a base of its own (Gemma 3) has no
    scaling; every other layer has the model's."""
    local = kind == SLIDING and cfg.local_rope_theta is not None
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    # Dims that do not rotate (rotary_layout) turn by an angle of 0.
    return F.pad(scaled_frequencies(inv_freq, None if local else cfg.rope_scaling), (0, (cfg.head_dim - dim) // 2))


def scaled_frequencies(inv_freq: torch.Tensor, s: dict | None) -> torch.Tensor:
    """The frequencies as `rope_scaling` s changes them (None: as they are)."""
    if s is None:
        return inv_freq.float()
    if s.get("rope_type") == "linear":
        return (inv_freq / s["factor"]).float()
    if s.get("rope_type") == "longrope":  # each frequency divided by its own factor
        return (inv_freq / torch.tensor(s["short_factor"], dtype=torch.float64)).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out).float()


def rope_tables(inv_freq: torch.Tensor, n_positions: int, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [n_positions, Dh] for the rotate-half layout of HF checkpoints; the sign of
    the first half is folded into sin so that apply_rope is a roll, two products and a sum. `scale`:
    LongRoPE's attention factor, on both (not on dims that do not rotate: a frequency of 0)."""
    angles = torch.arange(n_positions, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        scale = torch.where(inv_freq > 0, scale, 1.0)
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos,) * 2, -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rope(x: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, Dh], cos/sin [B, T, 1, Dh] → x's first n_heads heads rotated, [B, T, n_heads, Dh]
    (in x's own memory where the native kernel rotates them in place)."""
    if native.layer_ops_usable(x) and x.is_contiguous():
        native.rope_(x, cos, sin, n_heads)
        return x[:, :, :n_heads]
    x = x[:, :, :n_heads]
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


@dataclass
class Pass:
    """What every layer of one forward pass shares: where the cache is written and read, the
    attention mask, the rotary tables at the new positions."""
    cache: KVCache
    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B, T] where the new keys are written
    span: int  # keys the widest row sees after the pass
    mask: torch.Tensor | None  # additive [B, 1, T, span]; None when every key is visible
    cos: torch.Tensor  # [B, T, 1, Dh]
    sin: torch.Tensor
    end: torch.Tensor | None  # [B] the rows' cache lengths after the pass (None: the caller advances them)
    n_keys: torch.Tensor | None = None  # [B, T] keys each row sees, for the native kernel (see prepare_pass)
    window: int | None = None  # the native kernel's sliding window
    row_keys: list | None = None  # [B][T]: attend row by row over these keys (slices or indices; see prepare_pass)
    tree: torch.Tensor | None = None  # [B, T] int64: the new tokens row (b, t) sees, a bit each (draft trees)

    @functools.cached_property
    def at(self) -> CacheIndex:
        """Where the layer modules write and read the cache, built when the first one asks: a pass of
        native.decoder_layer calls writes the cache itself (building the index is not free at batch 1)."""
        return self.cache.index(self.slots, self.positions, self.span)


MAX_TREE_NODES = 64  # a pass's draft tree: each token's ancestors are the bits of an int64


def tree_layout(parents: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """A pass's new tokens as a draft tree, parents[b][t] the index of token t's parent among them (-1: the
    cached token before the pass; parents come before children) → (each token's depth below the cache,
    0 for a child of the cached token; each token's ancestors and itself as bits of the pass's tokens)."""
    depths, bits = [], []
    for row in parents:
        d, m = [], []
        for t, p in enumerate(row):
            d.append(d[p] + 1 if p >= 0 else 0)
            m.append((m[p] if p >= 0 else 0) | 1 << t)
        depths.append(d)
        bits.append(m)
    return depths, bits


class Rope:
    """Rotary tables for positions 0..n, grown on demand (a model's full context can be long)."""

    def __init__(self, scale: float = 1.0):
        self.cos = self.sin = None
        self.scale = scale  # ModelConfig.rope_scale

    def __call__(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(inv_freq.to(positions.device), int(positions.max()) + 1, dtype)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def tables(self, inv_freq: torch.Tensor, need: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables [n ≥ need, Dh]."""
        have = 0 if self.cos is None else len(self.cos)
        if have < need or self.cos.dtype != dtype or self.cos.device != inv_freq.device:
            self.cos, self.sin = rope_tables(inv_freq, max(need, 2 * have), dtype, self.scale)
        return self.cos, self.sin


def native_attention_usable(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a pass attends on the native kernel (each row over exactly its keys, within its sliding window):
    bf16 or fp32 on CPU, a head size the kernel takes."""
    return dtype in (torch.bfloat16, torch.float32) and device.type == "cpu" and native.attention_usable(head_dim)


def prepare_pass(cache: KVCache, slots: torch.Tensor, T: int, n_new: torch.Tensor | None, rope: Rope,
                 inv_freq: torch.Tensor, dtype: torch.dtype, window: int | None = None,
                 parents: list[list[int]] | None = None) -> Pass:
    """Row b's T inputs go at positions cache.lengths[slots[b]] onward; only its first n_new[b]
    (default T) are real, the rest is padding whose keys are never attended to and are overwritten
    later; padding past the last position goes to the cache's sink (KVCache).

    With `parents` (see tree_layout) the inputs are a draft tree: each is rotated for its depth and sees
    the cache and its own ancestors only, as if its branch had been decoded alone; the caller moves
    the keys of the branch it keeps into place (KVCache.move)."""
    start = cache.lengths[slots]  # [B]
    end = start + (T if n_new is None else n_new)
    span = int(end.max())
    cache.check_capacity(span)
    steps = torch.arange(T, device=slots.device)
    positions = start[:, None] + steps  # [B, T]
    if n_new is not None and span + T > cache.max_len:
        positions = positions.clamp(max=cache.max_len)
    tree = depths = bits = None
    rotated = positions  # [B, T] the positions rotary embeddings see
    if parents is not None:
        depths, bits = tree_layout(parents)
        rotated = start[:, None] + torch.tensor(depths, device=slots.device)
        tree = torch.tensor(bits, device=slots.device)
    cos, sin = rope(inv_freq, rotated, dtype)
    mask = row_keys = n_keys = None
    # PyTorch's CPU attention sums in an order that depends on the key count and the call's other rows,
    # and one rounding step makes that visible. A position's keys and values must be the same bits
    # whatever pass computed them (a whole prompt, a chunk of one, a verify pass, a decode step), or
    # speculative output drifts from plain output and a cached prefix (prefix_cache.py) differs from a
    # cold prefill. The native kernel attends each row over its own keys alone, in every pass; without
    # it, one sequence's passes attend row by row (linear kernels are row-invariant, models/kernels.py).
    if native_attention_usable(dtype, slots.device, 2 * len(inv_freq)):
        n_keys = positions + 1
    elif slots.device.type != "cpu" and (T > MAX_VERIFY_WIDTH or len(slots) > 1 or T == 1 or dtype == torch.float32
                                         or window is not None):
        # CUDA: its prompts and batches on its blocked kernels (row invariance there is docs/cuda.md's).
        if tree is not None or not (len(slots) == 1 and T == 1 and (window is None or span <= window)):
            mask = attention_mask(rotated, start, span, window, dtype, tree)
    elif tree is None and not (len(slots) == 1 and T == 1 and (window is None or span <= window)):
        low = (lambda p: 0) if window is None else (lambda p: max(0, p + 1 - window))
        row_keys = [[slice(low(p), p + 1) for p in range(first, first + T)] for first in start.tolist()]
    elif tree is not None:
        # A masked SDPA over a batch of trees is not row-exact: every row's nodes go row by row.
        real = [T] * len(slots) if n_new is None else n_new.tolist()
        row_keys = tree_row_keys(start.tolist(), real, depths, bits, window, slots.device)
    return Pass(cache, slots, positions, span, mask, cos, sin, end, n_keys, window, row_keys, tree)


def tree_row_keys(starts: list[int], real: list[int], depths: list[list[int]], bits: list[list[int]],
                  window: int | None, device: torch.device) -> list[list[torch.Tensor]]:
    """[B][T] the cache indices each node of a draft tree attends to: the cached keys, then its ancestors' and
    its own, each kept only if its position on the node's branch (a new key's is its depth) is in the window,
    as decoding the branch alone would see them. Row b's nodes past its first real[b] are padding: they read
    the last cached key (their output is never read, and their keys may lie past the pass's span)."""
    rows = []
    for first, n_real, row_depths, row_bits in zip(starts, real, depths, bits):
        row = []
        for t, (depth, lineage) in enumerate(zip(row_depths, row_bits)):
            if t >= n_real:
                row.append(torch.tensor([first - 1], device=device))
                continue
            low = 0 if window is None else min(first, max(0, first + depth + 1 - window))
            seen = [first + j for j, d in enumerate(row_depths)
                    if lineage >> j & 1 and (window is None or d > depth - window)]
            row.append(torch.cat((torch.arange(low, first, device=device), torch.tensor(seen, device=device))))
        rows.append(row)
    return rows


def attention_mask(positions: torch.Tensor, start: torch.Tensor, span: int, window: int | None, dtype: torch.dtype,
                   tree: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, T, span]: a query at position p sees keys 0..p (no further back than the window); in a
    draft tree (`tree`, see Pass) only the new keys of its ancestors and itself."""
    keys = torch.arange(span, device=positions.device)
    allowed = keys[None, None, :] <= positions[..., None]
    if tree is not None:
        new = (keys[None, :] - start[:, None]).clamp(0, MAX_TREE_NODES - 1)  # [B, span] a new key's bit
        allowed = (keys[None, None, :] < start[:, None, None]) | ((tree[..., None] >> new[:, None, :]) & 1 == 1)
    if window:
        # A tree's new key stands at its node's depth on the branch, not at its index in the cache.
        at = keys.expand(len(start), span)
        if tree is not None:
            new = keys[None, :] - start[:, None]  # [B, span]
            at = torch.where(new >= 0, positions.gather(1, new.clamp(0, positions.shape[1] - 1)), at)
        allowed &= at[:, None, :] > positions[..., None] - window
    # Additive once here rather than a boolean mask converted by every layer's attention.
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, -math.inf)[:, None]


def fuse_on_load(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Store the linear layers `parts` (name → output rows) as one, `fused`: one matmul reads all
    their weights in a pass. Checkpoints keep the separate Hugging Face names both ways: they are
    concatenated on load and split again in state_dict()."""

    def merge(state, prefix, *_):
        for suffix in ("weight", "bias"):
            names = [f"{prefix}{p}.{suffix}" for p in parts]
            if all(n in state for n in names):
                state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(n) for n in names])

    def split(_module, state, prefix, _meta):
        for suffix in ("weight", "bias"):
            key = f"{prefix}{fused}.{suffix}"
            # Only a plain [out, in] weight splits into the checkpoint's layers; packed or quantized
            # inference layouts (models/kernels.py, quantize.py) are not checkpoints.
            if key in state and state[key].shape[0] == sum(parts.values()) and not state[key].is_mkldnn:
                for p, piece in zip(parts, state.pop(key).split(list(parts.values()))):
                    state[f"{prefix}{p}.{suffix}"] = piece

    module.register_load_state_dict_pre_hook(lambda _m, state, prefix, *a: merge(state, prefix))
    module.register_state_dict_post_hook(split)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(x / cap) in x's dtype, in transformers' order (Gemma 2's scores and logits); x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, enable_gqa: bool = False, scale: float | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention with the scores soft-capped before the mask, which SDPA cannot do: the scores
    written out as transformers' eager attention computes them, the softmax in fp32."""
    if enable_gqa:
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = soft_cap(q @ keys.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale), softcap)
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fwd: Pass, gqa: bool,
           scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, T, Hq, Dh], keys/values [B, Hkv, span, Dh] → [B, T, Hq, Dh]; scores scaled by `scale` (1/√Dh) and
    soft-capped by `softcap`."""
    if fwd.n_keys is not None:
        return native.attention(q, keys, values, fwd.n_keys, fwd.tree, fwd.window, scale, softcap)
    q = q.transpose(1, 2)
    sdpa = F.scaled_dot_product_attention if softcap is None else functools.partial(capped_attention, softcap=softcap)
    if fwd.row_keys is None:
        out = sdpa(q, keys, values, attn_mask=fwd.mask, enable_gqa=gqa, scale=scale)
    else:
        out = torch.cat([torch.cat([sdpa(q[b:b + 1, :, t:t + 1], keys[b:b + 1, :, seen], values[b:b + 1, :, seen],
                                         enable_gqa=gqa, scale=scale)
                                    for t, seen in enumerate(row)], dim=2) for b, row in enumerate(fwd.row_keys)])
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, hd = cfg.dim, cfg.head_dim
        self.split = [cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads]
        self.qkv_proj = nn.Linear(d, sum(self.split) * hd, bias=cfg.qkv_bias)
        fuse_on_load(self, "qkv_proj", {"q_proj": cfg.n_heads * hd, "k_proj": cfg.n_kv_heads * hd,
                                        "v_proj": cfg.n_kv_heads * hd})
        if cfg.rotary_dim:
            permute_rotary_on_load(self, cfg)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, cache: KVCache, fwd: Pass) -> torch.Tensor:
        B, T, _ = x.shape
        cfg = self.cfg
        qkv = self.qkv_proj(x).view(B, T, -1, cfg.head_dim)  # [B, T, Hq + 2 Hkv, Dh]
        q, k, v = qkv.split(self.split, dim=2)
        qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2) if cfg.qk_norm else qkv
        q, k = apply_rope(qk, cfg.n_heads + cfg.n_kv_heads, fwd.cos, fwd.sin).split(self.split[:2], dim=2)
        keys, values = cache.update(self.layer, fwd.at, k.transpose(1, 2), v.transpose(1, 2))
        out = attend(q, keys, values, fwd, cfg.n_kv_heads != cfg.n_heads, cfg.query_scale, cfg.attn_softcap)
        return self.o_proj(out.reshape(B, T, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, size: int | None = None):
        super().__init__()
        n = size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * n, bias=cfg.mlp_bias)
        fuse_on_load(self, "gate_up_proj", {"gate_proj": n, "up_proj": n})
        self.down_proj = nn.Linear(n, cfg.dim, bias=cfg.mlp_bias)
        self.activation = cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu" and native.layer_ops_usable(gate_up):
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """One decoder layer. With sandwich norms (Gemma) post_attention_layernorm follows attention and two more
    surround the MLP; without, post_attention_layernorm is the MLP's input norm (Llama)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.kind = cfg.kind(layer)  # which of a pass's attention kinds (Transformer.forward) it reads
        norm = functools.partial(RMSNorm, cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = norm()
        self.mlp = (MoE(cfg.dim, cfg.n_experts, cfg.experts_per_token, cfg.routing, cfg.renormalise,
                        lambda: MLP(cfg, cfg.expert_size)) if cfg.routed(layer) else MLP(cfg))
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, cache: KVCache, fwd: Pass) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache, fwd))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cache, fwd)
        return x + self.mlp(self.post_attention_layernorm(x))

    @functools.cached_property
    def native_weights(self) -> list | None:
        """This layer's tensors as native.decoder_layer takes them, or None where it does not apply
        (a projection off the AMX kernels, biases, per-head q/k norms). Read on the first pass that
        asks: a model's weights are final by then (quantized and packed at load)."""
        attn, mlp = self.self_attn, self.mlp
        if not native_layer_form(attn.cfg, attn.layer):
            return None
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        qkv_bias = attn.qkv_proj.bias if isinstance(attn.qkv_proj, GGMLLinear) else None
        projections = [native_projection(p, bias_ok=p is attn.qkv_proj) for p in
                       (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(n.dtype != torch.bfloat16 for n in norms) or None in projections:
            return None
        return [*norms, attn.cfg.norm_eps, *projections, [] if qkv_bias is None else [qkv_bias]]

    def forward_native(self, x: torch.Tensor, cache: KVCache, fwd: Pass) -> torch.Tensor:
        """forward in one native call (csrc/decoder.cpp: the same kernels in the same order), for a
        pass with native attention (fwd.n_keys) and a layer whose native_weights is not None. It
        writes the layer's cache entries itself."""
        cfg, i = self.self_attn.cfg, self.self_attn.layer
        return native.decoder_layer(x, self.native_weights, fwd.cos, fwd.sin, cache.k[i], cache.v[i], fwd.slots,
                                    fwd.n_keys, cfg.n_heads, cfg.n_kv_heads, fwd.tree)


def native_layer_form(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` is the form csrc/decoder.cpp computes: Llama's norms, SiLU, no q/k norms, no
    sliding window, the usual score scale, uncapped scores, a dense MLP."""
    return (not (cfg.qk_norm or cfg.sandwich_norms or cfg.query_scale or cfg.window(layer) or cfg.routed(layer)
                 or cfg.attn_softcap) and cfg.activation == "silu")


def native_projection(linear: nn.Module, bias_ok: bool = False) -> list[torch.Tensor] | None:
    """A projection's weights as the native layer takes them: ggml_mm's 7 tensors a part (GGUF blocks),
    (q, scale, minimum) for the int4 kernel, (w) for the AMX bf16 one; None for any other kernel, or a
    bias (but the qkv projection's, `bias_ok`, which decoder.cpp adds for GGUF blocks)."""
    if isinstance(linear, GGMLLinear) and (linear.bias is None or bias_ok):
        return linear.weights
    if isinstance(linear, Int4Linear) and linear.native and linear.bias is None:
        return [linear.weight, linear.scale, linear.minimum]
    if isinstance(linear, PackedLinear) and linear.kind == "amx" and linear.bias is None:
        return [linear.weight]
    return None


def embedding_table(embed: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a table, ids into it) for the native decode pass: the embedding's own weight, or, for one that
    stores its rows quantized (gguf_native.GGMLEmbedding), the pass's rows alone."""
    if isinstance(embed, nn.Embedding):
        return embed.weight, tokens
    return embed(tokens).reshape(-1, embed.embedding_dim), torch.arange(tokens.numel()).view(tokens.shape)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)


def keep_input(kept: torch.Tensor | None, capture: tuple[int, ...], layer: int, x: torch.Tensor) -> None:
    """Copy x [B, T, D], the input of `layer`, into kept [n, B·T, D] wherever `capture` names that layer."""
    for j, i in enumerate(capture):
        if i == layer:
            kept[j] = x.reshape(-1, x.shape[-1])


def with_features(hidden: torch.Tensor, kept: torch.Tensor | None, B: int, T: int):
    """A pass's result: the hidden states alone, or with the captured layer inputs as [B, T, n·D]."""
    if kept is None:
        return hidden
    return hidden, kept.view(len(kept), B, T, -1).permute(1, 2, 0, 3).reshape(B, T, -1)


class Transformer(nn.Module):
    """A causal decoder that reads and writes a preallocated, ragged KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope = Rope(cfg.rope_scale)
        if cfg.local_rope_theta is not None and SLIDING in cfg.attention_kinds:
            self.register_buffer("local_inv_freq", rope_inv_freq(cfg, SLIDING), persistent=False)
            self.local_rope = Rope()
        # Narrow passes (decoding, verification) as prepare_pass builds them, or as the static passes of
        # models/cuda_graphs.py: run eagerly ("static"; tests on CPU, --enforce-eager on CUDA) or replayed
        # from CUDA graphs ("graphs", the default on CUDA).
        self.narrow_passes = "prepared"
        self.pass_graphs = None  # the holder of static passes (cuda_graphs.PassGraphs), set with narrow_passes
        self._graphs = weakref.WeakKeyDictionary()  # KVCache → its PassGraphs

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        # Norms are never quantized: they hold the activations' dtype.
        return self.model.norm.weight.dtype

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, max_batch, c.n_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def set_rope_frequencies(self, device: torch.device | str = "cpu") -> None:
        """The rotary frequencies again, in fp32 whatever the weights' dtype (a model built on the meta device
        has none)."""
        self.inv_freq = rope_inv_freq(self.cfg).to(device)
        if hasattr(self, "local_rope"):
            self.local_inv_freq = rope_inv_freq(self.cfg, SLIDING).to(device)

    def rope_for(self, kind: str) -> tuple[Rope, torch.Tensor]:
        """(the tables, the frequencies) of layers of `kind`."""
        if kind == SLIDING and hasattr(self, "local_rope"):
            return self.local_rope, self.local_inv_freq
        return self.rope, self.inv_freq

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] → [B, T, D]: the token embeddings, times √D in the families that scale them (in the
        embedding's dtype, as transformers rounds the factor)."""
        x = self.model.embed_tokens(tokens)
        if self.cfg.scale_embeddings:
            x = x * torch.tensor(self.cfg.dim ** 0.5, dtype=x.dtype)
        return x

    def prepare(self, cache: KVCache, slots: torch.Tensor, T: int, n_new: torch.Tensor | None,
                parents: list[list[int]] | None) -> dict[str, Pass]:
        """One Pass per kind of attention the layers have (their windows and rotary tables differ)."""
        passes = {}
        for kind in self.cfg.attention_kinds:
            rope, inv_freq = self.rope_for(kind)
            window = self.cfg.sliding_window if kind == SLIDING else None
            passes[kind] = prepare_pass(cache, slots, T, n_new, rope, inv_freq, self.dtype, window, parents)
        return passes

    def forward(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                n_new: torch.Tensor | None = None, parents: list[list[int]] | None = None,
                capture: tuple[int, ...] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append `tokens` [B, T] to the cache rows `slots` [B] and return final hidden states [B, T, D].

        Only row b's first n_new[b] tokens (default T) are real; `parents`: they are a draft tree (see
        prepare_pass); the cache lengths advance by n_new. `capture` (layer ids): also return the hidden
        states entering those layers, concatenated [B, T, n·D] in that order (Hugging Face's
        output_hidden_states[i]: id 0 the embeddings, id n_layers the last layer's output before the final
        norm), what an EAGLE-3 head reads; copies of the pass's own values, its arithmetic unchanged.
        """
        capture = tuple(capture or ())
        if any(not 0 <= i <= self.cfg.n_layers for i in capture):
            raise ValueError(f"capture ids {capture} out of [0, {self.cfg.n_layers}]")
        B, T = tokens.shape
        if not capture and self.narrow_passes != "prepared" and T <= MAX_VERIFY_WIDTH:  # graphs keep no copies
            return self.graphs_for(cache)(tokens, slots, n_new, parents)
        if parents is None and self.packs_ragged and n_new is not None and int(n_new.min()) < T:
            return self.forward_packed(tokens, cache, slots, n_new, capture)
        # The captured layer inputs, copied out as they pass (the native stack copies them in C++).
        kept = torch.empty(len(capture), B * T, self.cfg.dim, dtype=self.dtype, device=self.device) \
            if capture else None
        chain = parents is None and T <= MAX_VERIFY_WIDTH
        if chain and self.native_decode and self.native_stack is not None:
            cos, sin = self.rope.tables(self.inv_freq, cache.max_len + 1, self.dtype)
            table, ids = embedding_table(self.model.embed_tokens, tokens)
            hidden = self.native_stack.decode(ids, table, cos, sin, cache.k, cache.v, cache.lengths, slots,
                                              cache.max_len, n_new, kept, list(capture))
            if hidden is not None:
                return with_features(hidden, kept, B, T)
            # None: a row would run past the cache, which prepare_pass reports.
        passes = self.prepare(cache, slots, T, n_new, parents)
        fwd = next(iter(passes.values()))
        x = self.embed(tokens)
        if fwd.n_keys is not None and self.native_stack is not None:
            hidden = self.native_stack.forward(x.contiguous() if capture else x, fwd.cos, fwd.sin, cache.k, cache.v,
                                               fwd.slots, fwd.n_keys, fwd.tree, kept, list(capture))
        else:
            for i, block in enumerate(self.model.layers):
                keep_input(kept, capture, i, x)
                x = block(x, cache, passes[block.kind])
            keep_input(kept, capture, self.cfg.n_layers, x)
            hidden = self.model.norm(x)
        cache.lengths[slots] = fwd.end
        return with_features(hidden, kept, B, T)

    def forward_packed(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                       n_new: torch.Tensor, capture: tuple[int, ...] = ()) -> torch.Tensor | tuple:
        """forward for ragged rows on the native stack, every real token a row of its own: padding is never
        computed (on a CPU each position costs compute, and a batch's rows differ in width: accepted
        drafts, a prompt's chunk beside decoding). The native kernels give a row the same bits in any
        layout, and a pass writes every row's keys before any row attends."""
        B, T = tokens.shape
        start = cache.lengths[slots]  # [B]
        end = start + n_new
        cache.check_capacity(int(end.max()))
        real = torch.arange(T, device=tokens.device) < n_new[:, None]  # [B, T]
        positions = (start[:, None] + torch.arange(T, device=tokens.device))[real]  # [N]
        cos, sin = self.rope.tables(self.inv_freq, cache.max_len + 1, self.dtype)
        x = self.embed(tokens[real])[:, None]  # [N, 1, D]
        row_slots = slots[:, None].expand(B, T)[real]
        n, D = len(capture), x.shape[-1]
        kept = torch.empty(n, len(x), D, dtype=x.dtype, device=x.device) if n else None
        hidden = self.native_stack.forward(x, cos[positions][:, None, None], sin[positions][:, None, None], cache.k,
                                           cache.v, row_slots, (positions + 1)[:, None], None, kept, list(capture))
        cache.lengths[slots] = end
        out = hidden.new_zeros(B, T, hidden.shape[-1])
        out[real] = hidden[:, 0]
        if not n:
            return out
        features = hidden.new_zeros(B, T, n * D)
        features[real] = kept.permute(1, 0, 2).reshape(len(x), n * D)
        return out, features

    @property
    def packs_ragged(self) -> bool:
        """Whether a chain pass over rows of different widths runs without their padding (forward_packed)."""
        return self.narrow_passes == "prepared" and self.native_decode and self.native_stack is not None

    def graphs_for(self, cache: KVCache) -> PassGraphs:
        """The CUDA graphs of this model's passes over `cache` (a graph holds the cache's addresses)."""
        if cache not in self._graphs:
            self._graphs[cache] = self.pass_graphs(self, cache)
        return self._graphs[cache]

    @functools.cached_property
    def native_decode(self) -> bool:
        """Whether a chain pass of decoding or verification with the native stack runs as one native call
        from the cache's lengths (DecoderStack.decode): prepare_pass's native case."""
        return native_attention_usable(self.dtype, self.device, 2 * len(self.inv_freq))

    @functools.cached_property
    def native_stack(self) -> object | None:
        """Every layer and the final norm in one native call (native.decoder_stack: each layer as
        Block.forward_native computes it), or None where a layer runs as modules. Built on the first pass
        that asks: a model's weights are final by then (quantized and packed at load)."""
        weights = [block.native_weights for block in self.model.layers]
        # The stack embeds its tokens itself (decode), unscaled.
        if None in weights or self.model.norm.weight.dtype != torch.bfloat16 or self.cfg.scale_embeddings:
            return None
        return native.decoder_stack(weights, self.model.norm.weight, self.cfg.n_heads, self.cfg.n_kv_heads)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits in its dtype, soft-capped where the family caps them (Gemma 2): every caller
        that scores the target's tokens reads them here."""
        return soft_cap(self.lm_head(hidden), self.cfg.logit_softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
