"""Gated DeltaNet (Yang et al., 2025), the linear-attention layers of Qwen3.5 and Qwen3-Next.

Each row carries a recurrent state instead of keys and values: a causal depthwise conv1d's window of the last
K − 1 inputs, and an fp32 matrix S [value heads, dk, dv] per layer. Per token, after the conv and SiLU:

    S ← S·exp(g);  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq        (q, k L2-normalised, q scaled by 1/√dk)

with β = σ(b) and g = −exp(A_log)·softplus(a + dt_bias). Every pass runs this recurrence token by token, a whole
prompt as a decode step: a chunked form (transformers' prefill) rounds differently with where the chunks fall,
and then a state would depend on how a prompt was cut, which the prefix cache and speculation may not see.

A state cannot be truncated as keys can: the pass hands each position's state to the cache (state_cache.py),
which keeps them until the engine settles the row's length, so a rollback is a pick, never a recomputation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculant.models import native
from speculant.models.attention import Pass
from speculant.models.kernels import vectorized
from speculant.models.model_config import ModelConfig
from speculant.models.projections import fuse_on_load


class GatedRMSNorm(nn.Module):
    """RMSNorm by w (no offset) of each head's output, times SiLU(z), as transformers' Qwen3_5RMSNormGated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * vectorized(torch.rsqrt, x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * vectorized(F.silu, z.float())).to(dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * vectorized(torch.rsqrt, (x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.index = cfg.linear_layers.index(layer)  # its states' place among the model's linear layers
        self.k_heads, self.v_heads = cfg.linear_k_heads, cfg.linear_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_dim, cfg.linear_v_dim
        key_dim, value_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.split = [key_dim, key_dim, value_dim]
        self.conv_dim = sum(self.split)
        self.kernel = cfg.conv_kernel
        self.tiled = cfg.linear_heads_tiled
        # One product reads the four input projections (the checkpoint's names both ways).
        self.parts = {"in_proj_qkv": self.conv_dim, "in_proj_z": value_dim, "in_proj_b": self.v_heads,
                      "in_proj_a": self.v_heads}
        self.in_proj = nn.Linear(cfg.dim, sum(self.parts.values()), bias=False)
        fuse_on_load(self, "in_proj", self.parts)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.dim, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A row's (recurrent matrix, conv window) shapes."""
        return (self.v_heads, self.k_dim, self.v_dim), (self.conv_dim, self.kernel - 1)

    def forward(self, x: torch.Tensor, cache, fwd: Pass) -> torch.Tensor:
        B, T, _ = x.shape
        slots = fwd.slots.tolist()
        starts = fwd.positions[:, 0].tolist()
        n_real = (fwd.end - fwd.positions[:, 0]).tolist()
        qkv, z, b, a = self.in_proj(x).split(list(self.parts.values()), dim=-1)
        state, window = cache.read_states(self.index, slots, starts, x.dtype)
        # The conv over [window, new inputs], tap by tap in a fixed order: a position's sum is the same bits in
        # any pass (a library conv may order it by the sequence's length).
        seq = torch.cat((window, qkv.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
        w = self.conv1d.weight[:, 0]  # [C, K]
        conv = seq[..., :T] * w[:, :1]
        for i in range(1, self.kernel):
            conv = conv + seq[..., i:i + T] * w[:, i:i + 1]
        # Elementwise ops here see tensors whose size follows the pass (vectorized: the same bits in any pass).
        q, k, v = vectorized(F.silu, conv).transpose(1, 2).split(self.split, dim=-1)
        beta = vectorized(torch.sigmoid, b)
        g = -self.A_log.float().exp() * vectorized(F.softplus, a.float() + self.dt_bias)
        keep = cache.positions_to_keep(slots, starts, n_real, T)
        if native.gdn_usable(x):
            out = self.recurrence_native(q, k, v, beta, g, state, keep, cache, slots, starts, seq)
        else:
            out = self.recurrence(q, k, v, beta, g, state, keep, cache, slots, starts, seq).transpose(1, 2)
        out = self.norm(out.to(x.dtype), z.reshape(B, T, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(B, T, -1))

    def recurrence_native(self, q, k, v, beta, g, state, keep, cache, slots, starts, seq) -> torch.Tensor:
        """The recurrence in one call (csrc/gdn.cpp) → [B, T, v heads, dv] fp32."""
        B, T = q.shape[:2]
        marks = torch.zeros(B, T, dtype=torch.bool)
        for t, rows in enumerate(keep):
            marks[rows, t] = True
        shape = (B, T, self.k_heads, self.k_dim)
        out, kept = native.gdn_recurrence(q.float().reshape(shape).contiguous(), k.float().reshape(shape).contiguous(),
                                          v.float().reshape(B, T, self.v_heads, self.v_dim).contiguous(),
                                          beta.float().contiguous(), g.contiguous(), state.contiguous(), marks,
                                          self.tiled)
        for (row, t), matrix in zip(marks.nonzero().tolist(), kept):
            cache.record_state(self.index, slots[row], starts[row] + t + 1, matrix, seq[row, :, t + 1:t + self.kernel])
        return out

    def recurrence(self, q, k, v, beta, g, state, keep, cache, slots, starts, seq) -> torch.Tensor:
        """The recurrence in PyTorch, where the native kernels do not run → [B, v heads, T, dv] fp32."""
        B, T = q.shape[:2]
        repeat = self.v_heads // self.k_heads
        q, k = (t.reshape(B, T, self.k_heads, self.k_dim) for t in (q, k))
        if self.tiled:  # value head j reads key head j mod k_heads
            q, k = q.repeat(1, 1, repeat, 1), k.repeat(1, 1, repeat, 1)
        else:  # value heads grouped by their key head
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        v = v.reshape(B, T, self.v_heads, self.v_dim)
        q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))  # [B, H, T, …]
        q, k = l2norm(q) * self.k_dim ** -0.5, l2norm(k)
        decay = vectorized(torch.exp, g)
        out = torch.empty_like(v)
        for t in range(T):
            state = state * decay[:, :, t, None, None]
            k_t = k[:, :, t, :, None]
            delta = (v[:, :, t] - (state * k_t).sum(dim=-2)) * beta[:, :, t, None]
            state = state + k_t * delta[:, :, None, :]
            out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
            for row in keep[t]:  # the state after t + 1 tokens, and the window of the inputs before them
                cache.record_state(self.index, slots[row], starts[row] + t + 1, state[row],
                                   seq[row, :, t + 1:t + self.kernel])
        return out


def ungroup_linear_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba, whose rows are grouped per key head ([q, k, v…, z…] and [b…, a…]
    for each), → Qwen3.5's in_proj_qkv (every q, then every k, then every v), in_proj_z, in_proj_b, in_proj_a."""
    hk, r = cfg.linear_k_heads, cfg.linear_v_heads // cfg.linear_k_heads
    dk, dv = cfg.linear_k_dim, cfg.linear_v_dim
    out = {}
    for name, w in state.items():
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            q, k, v, z = w.view(hk, -1, w.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
            prefix = name.removesuffix("in_proj_qkvz.weight")
            flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
            out[prefix + "in_proj_qkv.weight"] = torch.cat(flat[:3])
            out[prefix + "in_proj_z.weight"] = flat[3]
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            b, a = w.view(hk, 2 * r, w.shape[-1]).split([r, r], dim=1)
            prefix = name.removesuffix("in_proj_ba.weight")
            out[prefix + "in_proj_b.weight"] = b.reshape(-1, w.shape[-1])
            out[prefix + "in_proj_a.weight"] = a.reshape(-1, w.shape[-1])
        else:
            out[name] = w
    return out
