"""Rotary position embeddings: the frequencies each layer kind turns by (with llama3, linear and LongRoPE scaling),
their cos/sin tables, and the layout that lets partial rotary (Phi-4-mini) run on the full-rotation kernels."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speculant.models import native
from speculant.models.model_config import FULL, SLIDING, ModelConfig


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
    """Store qkv_proj's rows in rotary_rows' order (and q/k norms' weights in rotary_layout's); state_dict() gives
    the checkpoint's order back."""

    def on_load(_module, state, prefix, *_):
        for suffix in ("weight", "bias"):
            key = f"{prefix}qkv_proj.{suffix}"
            if key in state:  # fuse_on_load ran first; the order is made here, as the model is on the meta device
                rows = rotary_rows(cfg)
                rows = torch.cat((rows, torch.arange(len(rows), state[key].shape[0])))  # gate rows (Qwen3.5) stay
                state[key] = state[key][rows.to(state[key].device)]
        for norm in ("q_norm", "k_norm"):  # per-head norms scale each dim: their weights follow the dims
            key = f"{prefix}{norm}.weight"
            if key in state:
                state[key] = state[key][rotary_layout(cfg.head_dim, cfg.rotary_dim).to(state[key].device)]

    def on_save(_module, state, prefix, _meta):
        rows = rotary_rows(cfg)
        q_rows, k_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for name, order in (("q_proj", rows[:q_rows]), ("k_proj", rows[q_rows:q_rows + k_rows] - q_rows)):
            for suffix in ("weight", "bias"):
                key = f"{prefix}{name}.{suffix}"
                if key in state:
                    state[key] = state[key][order.argsort().to(state[key].device)]
        for norm in ("q_norm", "k_norm"):
            key = f"{prefix}{norm}.weight"
            if key in state:
                state[key] = state[key][rotary_layout(cfg.head_dim, cfg.rotary_dim).argsort().to(state[key].device)]

    attn.register_load_state_dict_pre_hook(on_load)
    attn.register_state_dict_post_hook(on_save)


def rope_inv_freq(cfg: ModelConfig, kind: str = FULL) -> torch.Tensor:
    """The rotary frequencies of layers of `kind`: a sliding layer with a base of its own (Gemma 3) has no
    scaling; every other layer has the model's."""
    local = kind == SLIDING and cfg.local_rope_theta is not None
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    if not local and (cfg.rope_scaling or {}).get("rope_type") == "proportional":
        return proportional_frequencies(theta, cfg.kind_head_dim(kind), cfg.rope_scaling)
    dim = cfg.rotary_dim or cfg.kind_head_dim(kind)
    # On the CPU even where a model is built on the meta device: meta's arange imports torch._dynamo (seconds).
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if not local and (cfg.rope_scaling or {}).get("rope_type") == "yarn":
        return F.pad(yarn_frequencies(theta, dim, cfg.rope_scaling), (0, (cfg.head_dim - dim) // 2))
    # Dims that do not rotate (rotary_layout) turn by an angle of 0.
    return F.pad(scaled_frequencies(inv_freq, None if local else cfg.rope_scaling),
                 (0, (cfg.kind_head_dim(kind) - dim) // 2))


def proportional_frequencies(theta: float, head_dim: int, s: dict) -> torch.Tensor:
    """Gemma 4's global layers: the first partial_rotary_factor of the angles turn as in a head of head_dim (the
    exponent over the whole head), divided by `factor`; the rest turn by 0 (in fp32, as transformers)."""
    angles = int(s["partial_rotary_factor"] * head_dim // 2)
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / head_dim) / s["factor"]
    return F.pad(inv_freq, (0, head_dim // 2 - angles))


def yarn_frequencies(theta: float, dim: int, s: dict) -> torch.Tensor:
    """YaRN's frequencies: the fast ones kept, the slow ones divided by `factor`, a linear ramp between the
    dims that turn beta_fast and beta_slow times over the pretrained context (in fp32, as transformers)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency extrapolated (kept as it is)
    return (1.0 / (s["factor"] * pos)) * (1 - keep) + (1.0 / pos) * keep


def scaled_frequencies(inv_freq: torch.Tensor, s: dict | None) -> torch.Tensor:
    """The frequencies as `rope_scaling` s changes them (None: as they are)."""
    if s is None:
        return inv_freq.float()
    if s.get("rope_type") == "linear":
        return (inv_freq / s["factor"]).float()
    if s.get("rope_type") == "longrope":  # each frequency divided by its own factor
        return (inv_freq / torch.tensor(s["short_factor"], dtype=torch.float64, device=inv_freq.device)).float()
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
