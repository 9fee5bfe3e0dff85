"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) in plain PyTorch.

RMSNorm, RoPE, SwiGLU, grouped-query attention; optional qkv bias (Qwen2) and per-head
q/k RMSNorm (Qwen3). Parameter names follow Hugging Face's so checkpoints load as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speculant.errors import SpeculantError
from speculant.models.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


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

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
        if known:
            model_type = known[0]
        elif model_type not in SUPPORTED_ARCHITECTURES.values():
            name = ", ".join(archs) or model_type or "unknown"
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
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise SpeculantError(f"{source}: unsupported rope_scaling type '{kind}' (supported: llama3).")
            if kind == "default":
                scaling = None
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias") or model_type == "qwen2"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, Dh]; cos/sin: [B, 1, T, Dh] (rotate-half layout, as in HF checkpoints)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, hd = cfg.dim, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def forward(self, x, cos, sin, cache: KVCache, slots, rows, positions, mask) -> torch.Tensor:
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.update(self.layer, slots, rows, positions, k, v, span=mask.shape[-1])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=cfg.n_kv_heads != cfg.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, slots, rows, positions, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, rows, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


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

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        # The embedding is never quantized: it holds the activations' dtype.
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, max_batch, c.n_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                n_new: torch.Tensor | None = None) -> torch.Tensor:
        """Append `tokens` [B, T] to the cache rows `slots` [B] and return final hidden states [B, T, D].

        Row b's tokens go at positions cache.lengths[slots[b]] onward; only its first n_new[b]
        (default T) are real, the rest is padding whose keys are never attended to and are
        overwritten later. The cache lengths advance by n_new.
        """
        B, T = tokens.shape
        if n_new is None:
            n_new = torch.full((B,), T, dtype=torch.long, device=tokens.device)
        start = cache.lengths[slots]  # [B]
        positions = start[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        cache.check_capacity(int((start + T).max()))
        span = int((start + n_new).max())
        mask = self._mask(positions, span)
        angles = positions[..., None].float() * self.inv_freq  # [B, T, Dh/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, Dh]
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        rows = cache.read_rows(slots)
        x = self.model.embed_tokens(tokens)
        for block in self.model.layers:
            x = block(x, cos, sin, cache, slots, rows, positions, mask)
        cache.lengths[slots] = start + n_new
        return self.model.norm(x)

    def _mask(self, positions: torch.Tensor, span: int) -> torch.Tensor:
        # [B, 1, T, span]: query at position p sees keys 0..p (and no further back than the window).
        keys = torch.arange(span, device=positions.device)
        allowed = keys[None, None, :] <= positions[..., None]
        if self.cfg.sliding_window:
            allowed &= keys[None, None, :] > positions[..., None] - self.cfg.sliding_window
        return allowed[:, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
