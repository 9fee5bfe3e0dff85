"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) in plain PyTorch.

RMSNorm, RoPE, SwiGLU, grouped-query attention; optional qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3)
and routed experts in place of the MLP (Qwen3-MoE, Mixtral: moe.py). Parameter names follow Hugging Face's
so checkpoints load as they are.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from speculant.models import native
from speculant.models.attention import Pass, attend, native_attention_usable, prepare_pass, soft_cap
from speculant.models.gdn import GatedDeltaNet
from speculant.models.ggml import GGMLLinear
from speculant.models.kernels import vectorized
from speculant.models.kv_cache import KVCache
from speculant.models.limits import MAX_VERIFY_WIDTH
from speculant.models.model_config import FULL, SLIDING, ModelConfig
from speculant.models.moe import TOPK_SOFTMAX, MoE
from speculant.models.projections import fuse_on_load, native_projection
from speculant.models.rope import Rope, apply_rope, permute_rotary_on_load, rope_inv_freq
from speculant.models.state_cache import HybridCache

if TYPE_CHECKING:
    from speculant.models.cuda_graphs import PassGraphs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # A folded 1 + w stays fp32 whatever the model is cast to: transformers adds the 1 in fp32 in every pass,
        # and the sum in bf16 loses w's low bits.
        self.fp32 = bool(offset)
        if offset:
            fold_offset_on_load(self, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype and native.layer_ops_usable(x):
            return native.rms_norm(x, self.weight, self.eps)
        if self.weight.dtype != x.dtype:  # an fp32 scale on bf16 rows: normalised and scaled in fp32, rounded once
            return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)
        # One call (it normalises bf16/fp16 in fp32 and rounds once): a separate upcast, cast back and
        # weight product were three more operations per norm, 61 norms per pass.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def _apply(self, fn, recurse: bool = True):
        before = self.weight.detach()
        super()._apply(fn, recurse)
        if self.fp32 and self.weight.dtype != torch.float32:  # a cast to another dtype: the fp32 values kept
            kept = self.weight if before.is_meta else before
            self.weight = nn.Parameter(kept.to(self.weight.device, torch.float32), self.weight.requires_grad)
        return self


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        # Its place in the KV cache: hybrid models keep keys for their attention layers alone, and a KV-shared
        # layer (Gemma 4) reads its source layer's.
        source = cfg.kv_source[layer] if cfg.kv_source else layer
        owners = cfg.cache_layers
        self.kv_layer = owners.index(source) if source in owners else layer - sum(i < layer for i in cfg.linear_layers)
        self.shared = cfg.shared(layer)
        d, hd, hkv = cfg.dim, cfg.head_dim_of(layer), cfg.kv_heads_of(layer)
        self.hd, self.hkv = hd, hkv
        self.k_eq_v = cfg.k_eq_v and cfg.kind(layer) == FULL  # v is k's projection, before k's norm
        self.split = [cfg.n_heads, hkv, hkv]
        self.gated = cfg.attention_gate
        if self.gated:  # the output gate's rows follow v's in the fused projection
            split_gate_on_load(self, cfg.n_heads, hd)
        parts = {"q_proj": cfg.n_heads * hd}
        if not self.shared:
            parts |= {"k_proj": hkv * hd} if self.k_eq_v else {"k_proj": hkv * hd, "v_proj": hkv * hd}
        if self.gated:
            parts["q_gate"] = cfg.n_heads * hd
        self.qkv_proj = nn.Linear(d, sum(parts.values()), bias=cfg.qkv_bias)
        fuse_on_load(self, "qkv_proj", parts)
        if cfg.rotary_dim:
            permute_rotary_on_load(self, cfg)
        if self.gated:
            join_gate_on_save(self, cfg.n_heads, hd)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=cfg.o_bias)
        if cfg.attention_sinks:  # a logit per head that weighs no value (attention.sink_attention)
            self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_offset)
            if not self.shared:
                self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, cache: KVCache, fwd: Pass) -> torch.Tensor:
        B, T, _ = x.shape
        cfg, H, hd, hkv = self.cfg, self.cfg.n_heads, self.hd, self.hkv
        qkv = self.qkv_proj(x).view(B, T, -1, hd)  # [B, T, Hq + 2 Hkv (+ Hq gates), Dh]
        if self.shared:  # queries only: the keys and values are the source layer's, written earlier in the pass
            q = apply_rope(self.q_norm(qkv) if cfg.qk_norm else qkv, H, fwd.cos, fwd.sin)
            keys, values = cache.read(self.kv_layer, fwd.at, hkv, hd)
            return self.o_proj(self.attend(q, keys, values, fwd).reshape(B, T, H * hd))
        if self.k_eq_v:
            q, k = qkv.split(self.split[:2], dim=2)
            v, gate = k, []
        else:
            q, k, v, *gate = qkv.split(self.split + [H] * self.gated, dim=2)
        if cfg.value_norm:  # weightless
            v = F.rms_norm(v, (hd,), None, cfg.norm_eps)
        qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2) if cfg.qk_norm else qkv
        if self.layer in cfg.nope_layers:
            q, k = qk[:, :, :H + hkv].split(self.split[:2], dim=2)
        else:
            q, k = apply_rope(qk, H + hkv, fwd.cos, fwd.sin).split(self.split[:2], dim=2)
        keys, values = cache.update(self.kv_layer, fwd.at, k.transpose(1, 2), v.transpose(1, 2))
        out = self.attend(q, keys, values, fwd).reshape(B, T, H * hd)
        if self.gated:
            out = out * vectorized(torch.sigmoid, gate[0].reshape(out.shape))
        return self.o_proj(out)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fwd: Pass) -> torch.Tensor:
        cfg = self.cfg
        return attend(q, keys, values, fwd, self.hkv != cfg.n_heads, cfg.query_scale, cfg.attn_softcap,
                      self.sinks if cfg.attention_sinks else None)


def split_gate_on_load(attn: nn.Module, n_heads: int, head_dim: int) -> None:
    """A gated checkpoint's q_proj holds each head's query rows then its gate rows: split into q_proj and q_gate
    (before fuse_on_load joins them with k and v)."""

    def split(_module, state, prefix, *_):
        for suffix in ("weight", "bias"):
            key = f"{prefix}q_proj.{suffix}"
            if key in state and state[key].shape[0] == 2 * n_heads * head_dim:
                q, gate = state[key].view(n_heads, 2, head_dim, -1).unbind(1)
                state[key], state[f"{prefix}q_gate.{suffix}"] = q.reshape(n_heads * head_dim, -1).squeeze(-1), \
                    gate.reshape(n_heads * head_dim, -1).squeeze(-1)

    attn.register_load_state_dict_pre_hook(split)


def join_gate_on_save(attn: nn.Module, n_heads: int, head_dim: int) -> None:
    """state_dict() gives the checkpoint's interleaved q_proj back (after fuse_on_load and the rotary order)."""

    def join(_module, state, prefix, _meta):
        for suffix in ("weight", "bias"):
            q, gate = f"{prefix}q_proj.{suffix}", f"{prefix}q_gate.{suffix}"
            if q in state and gate in state:
                rows = torch.stack((state[q].view(n_heads, head_dim, -1), state.pop(gate).view(n_heads, head_dim, -1)),
                                   dim=1)
                state[q] = rows.reshape(2 * n_heads * head_dim, -1).squeeze(-1) if suffix == "bias" else \
                    rows.reshape(2 * n_heads * head_dim, -1)

    attn.register_state_dict_post_hook(join)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, size: int | None = None):
        super().__init__()
        n = size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * n, bias=cfg.mlp_bias)
        fuse_on_load(self, "gate_up_proj", {"gate_proj": n, "up_proj": n})
        self.down_proj = nn.Linear(n, cfg.dim, bias=cfg.mlp_bias)
        self.activation = cfg.activation
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "swiglu_clamped":  # gpt-oss: both halves clamped, σ(α·gate), up shifted by 1
            gate, up = gate_up.chunk(2, dim=-1)
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        if native.layer_ops_usable(gate_up):  # the native layer's own kernels (decoder.cpp), the same bits
            return self.down_proj(native.gelu_tanh_mul(gate_up) if self.activation == "gelu_tanh"
                                  else native.silu_mul(gate_up))
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
        self.native_form = native_layer_form(cfg, layer)
        norm = functools.partial(RMSNorm, cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.input_layernorm = norm()
        if cfg.linear(layer):
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = norm()
        shared = MLP(cfg, cfg.shared_expert_size) if cfg.shared_expert_size else None
        wide = 2 * cfg.intermediate_size if cfg.double_wide_shared_mlp and cfg.shared(layer) else None
        experts = functools.partial(MoE, cfg.dim, cfg.n_experts, cfg.experts_per_token, cfg.routing, cfg.renormalise,
                                    lambda: MLP(cfg, cfg.expert_size), shared, cfg.router_bias)
        self.mlp = experts() if cfg.routed(layer) and not cfg.moe_beside_mlp else MLP(cfg, wide)
        if cfg.routed(layer) and cfg.moe_beside_mlp:  # Gemma 4's experts, each side normed before and after
            self.moe = experts()
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        if cfg.ple_dim:  # Gemma 4's per-layer input: gated by the layer's output, projected back, normed, added
            self.per_layer_input_gate = nn.Linear(cfg.dim, cfg.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(cfg.ple_dim, cfg.dim, bias=False)
            self.post_per_layer_input_norm = norm()
        if cfg.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))

    @property
    def mixer(self) -> nn.Module:
        """What mixes the positions: attention, or a hybrid model's Gated DeltaNet."""
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, x: torch.Tensor, cache: KVCache, fwd: Pass, per_layer: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`per_layer` [B, T, P]: this layer's per-layer input (Gemma 4)."""
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache, fwd))
            h = self.mlp(self.pre_feedforward_layernorm(x))
            if hasattr(self, "moe"):  # the experts read the layer's input to the MLP, before its norm
                h = self.post_feedforward_layernorm_1(h) + \
                    self.post_feedforward_layernorm_2(self.moe(self.pre_feedforward_layernorm_2(x), x))
            x = x + self.post_feedforward_layernorm(h)
            if per_layer is not None:
                gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer
                x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
            return x * self.layer_scalar if hasattr(self, "layer_scalar") else x
        x = x + self.mixer(self.input_layernorm(x), cache, fwd)
        return x + self.mlp(self.post_attention_layernorm(x))

    @functools.cached_property
    def native_weights(self) -> native.NativeLayer | None:
        """This layer as native.decoder_layer takes it, or None where it does not apply (a projection off the
        native kernels, biases, routed experts). Read on the first pass that asks: a model's weights are final
        by then (quantized and packed at load)."""
        if not self.native_form:
            return None
        attn, mlp = self.self_attn, self.mlp
        cfg, layer = attn.cfg, attn.layer
        routed = isinstance(mlp, MoE)
        norms = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        qk_norms = [attn.q_norm.weight, attn.k_norm.weight] if cfg.qk_norm else []
        mlp_norms = [self.pre_feedforward_layernorm.weight, self.post_feedforward_layernorm.weight] \
            if self.sandwich else []
        qkv_bias = attn.qkv_proj.bias if isinstance(attn.qkv_proj, GGMLLinear) else None
        projections = [native_projection(p, bias_ok=p is attn.qkv_proj) for p in (attn.qkv_proj, attn.o_proj)]
        projections += [[], []] if routed else [native_projection(p) for p in (mlp.gate_up_proj, mlp.down_proj)]
        router, experts = mlp.native_parts(norms[1]) if routed else ([], None)
        if any(n.dtype != torch.bfloat16 for n in norms + qk_norms + mlp_norms) or None in projections or \
                routed and experts is None:
            return None
        local_rope = cfg.kind(layer) == SLIDING and cfg.local_rope_theta is not None  # Transformer.rope_for's choice
        routing = (mlp.top_k, mlp.routing == TOPK_SOFTMAX, mlp.renormalise) if routed else (0, False, False)
        form = (cfg.window(layer) or 0, cfg.query_scale or 0.0, cfg.attn_softcap or 0.0,
                cfg.activation == "gelu_tanh", local_rope, *routing)
        groups = [*([n] for n in norms), *projections, [] if qkv_bias is None else [qkv_bias], qk_norms, mlp_norms,
                  router]
        return native.NativeLayer(groups, cfg.norm_eps, form, experts)

    def forward_native(self, x: torch.Tensor, cache: KVCache, fwd: Pass) -> torch.Tensor:
        """forward in one native call (csrc/decoder.cpp: the same kernels in the same order), for a
        pass with native attention (fwd.n_keys) and a layer whose native_weights is not None. It
        writes the layer's cache entries itself."""
        cfg, i = self.self_attn.cfg, self.self_attn.kv_layer
        return native.decoder_layer(x, self.native_weights, fwd.cos, fwd.sin, cache.k[i], cache.v[i], fwd.slots,
                                    fwd.n_keys, cfg.n_heads, cfg.n_kv_heads, fwd.tree)


def native_layer_form(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` is a form csrc/decoder.cpp computes: a dense MLP gated by SiLU or GELU, or SwiGLU
    experts without a shared one (every form of norms, windows, score scales and caps the families here have;
    not yet a hybrid model's layers, a layer without RoPE (SmolLM3's), attention sinks (gpt-oss) or Gemma 4's
    layers: they run as modules)."""
    if cfg.attention_gate or layer in cfg.nope_layers or cfg.value_norm or cfg.attention_sinks:
        return False
    if cfg.routed(layer):
        return cfg.activation == "silu" and not cfg.shared_expert_size
    return cfg.activation in ("silu", "gelu_tanh")


def embedding_table(embed: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a table, ids into it) for the native decode pass: the embedding's own weight, or, for one that
    stores its rows quantized (gguf_native.GGMLEmbedding), the pass's rows alone."""
    if isinstance(embed, nn.Embedding):
        return embed.weight, tokens
    return embed(tokens).reshape(-1, embed.embedding_dim), torch.arange(tokens.numel()).view(tokens.shape)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Given its weight, nn.Embedding skips its random init, whose first call imports torch._dynamo (seconds):
        # every checkpoint overwrites it.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        if cfg.ple_dim:  # Gemma 4's per-layer embeddings: a token's row of every layer's input, and a projection
            width = cfg.n_layers * cfg.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(cfg.ple_vocab, width, _weight=torch.empty(cfg.ple_vocab, width))
            self.per_layer_model_projection = nn.Linear(cfg.dim, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(cfg.ple_dim, cfg.norm_eps, cfg.norm_offset)

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, T] tokens and their scaled embeddings [B, T, D] → every layer's input [B, T, L, P]: the normed
        projection of the embeddings plus the token's per-layer row (times √P), over √2, as transformers."""
        B, T = tokens.shape
        L, P = len(self.layers), self.per_layer_projection_norm.weight.shape[0]
        rows = self.embed_tokens_per_layer(tokens) * torch.tensor(P ** 0.5, dtype=x.dtype)
        proj = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(B, T, L, P))
        return (proj + rows.reshape(B, T, L, P)) * 2.0 ** -0.5


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
        # The embeddings' rows are the activations' dtype (Gemma's norms keep fp32: RMSNorm).
        embed = self.model.embed_tokens
        return embed.weight.dtype if isinstance(embed, nn.Embedding) else embed.dtype

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c = self.cfg
        if c.linear_layers:
            shapes = self.model.layers[c.linear_layers[0]].linear_attn.state_shapes()
            return HybridCache(c.n_layers - len(c.linear_layers), max_batch, c.n_kv_heads, max_len, c.head_dim,
                               self.dtype, self.device, len(c.linear_layers), shapes)
        # Gemma 4: the layers that keep keys, each as wide as the widest (its sliding layers use their first dims).
        heads = max(c.kv_heads_of(i) for i in c.cache_layers)
        dim = max(c.head_dim_of(i) for i in c.cache_layers)
        return KVCache(len(c.cache_layers), max_batch, heads, max_len, dim, self.dtype, self.device)

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

    def rope_tables(self, n: int) -> list[torch.Tensor]:
        """cos and sin [≥ n, Dh] of the layers on the model's rotary frequencies, then the local layers' where
        they have their own (the native stack's tables)."""
        tables = list(self.rope.tables(self.inv_freq, n, self.dtype))
        if hasattr(self, "local_rope"):
            tables += self.local_rope.tables(self.local_inv_freq, n, self.dtype)
        return tables

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
            passes[kind] = prepare_pass(cache, slots, T, n_new, rope, inv_freq, self.dtype, window, parents,
                                        native_ok=not self.cfg.attention_sinks)
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
            cos, sin, *local = self.rope_tables(cache.max_len + 1)
            table, ids = embedding_table(self.model.embed_tokens, tokens)
            hidden = self.native_stack.decode(ids, table, cos, sin, cache.k, cache.v, cache.lengths, slots,
                                              cache.max_len, n_new, kept, list(capture), *local)
            if hidden is not None:
                return with_features(hidden, kept, B, T)
            # None: a row would run past the cache, which prepare_pass reports.
        passes = self.prepare(cache, slots, T, n_new, parents)
        fwd = next(iter(passes.values()))
        x = self.embed(tokens)
        if fwd.n_keys is not None and self.native_stack is not None:
            glob = passes.get(FULL, fwd)  # the tables of layers without local ones (rope_for)
            local = (passes[SLIDING].cos, passes[SLIDING].sin) if hasattr(self, "local_rope") else ()
            hidden = self.native_stack.forward(x.contiguous() if capture else x, glob.cos, glob.sin, cache.k, cache.v,
                                               fwd.slots, fwd.n_keys, fwd.tree, kept, list(capture), *local)
        else:
            per_layer = self.model.per_layer_inputs(tokens, x) if self.cfg.ple_dim else None
            for i, block in enumerate(self.model.layers):
                keep_input(kept, capture, i, x)
                x = block(x, cache, passes[block.kind], None if per_layer is None else per_layer[:, :, i])
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
        rows = [t[positions][:, None, None] for t in self.rope_tables(cache.max_len + 1)]  # cos, sin[, local ones]
        x = self.embed(tokens[real])[:, None]  # [N, 1, D]
        row_slots = slots[:, None].expand(B, T)[real]
        n, D = len(capture), x.shape[-1]
        kept = torch.empty(n, len(x), D, dtype=x.dtype, device=x.device) if n else None
        cos, sin, *local = rows
        hidden = self.native_stack.forward(x, cos, sin, cache.k, cache.v, row_slots, (positions + 1)[:, None], None,
                                           kept, list(capture), *local)
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
        from the cache's lengths (DecoderStack.decode): prepare_pass's native case (never with attention sinks,
        which the native kernels do not add)."""
        return not self.cfg.attention_sinks and native_attention_usable(self.dtype, self.device,
                                                                        2 * len(self.inv_freq))

    @functools.cached_property
    def native_stack(self) -> object | None:
        """Every layer and the final norm in one native call (native.decoder_stack: each layer as
        Block.forward_native computes it), or None where a layer runs as modules. Built on the first pass
        that asks: a model's weights are final by then (quantized and packed at load)."""
        weights = [block.native_weights for block in self.model.layers]
        if None in weights or self.model.norm.weight.dtype != torch.bfloat16:
            return None
        return native.decoder_stack(weights, self.model.norm.weight, self.cfg.n_heads, self.cfg.n_kv_heads,
                                    self.embed_scale)

    @property
    def embed_scale(self) -> float:
        """The native stack's decode pass embeds its tokens itself: times √D rounded to the dtype, as embed()
        scales them, in the families that do (0: unscaled)."""
        return float(torch.tensor(self.cfg.dim ** 0.5, dtype=self.dtype)) if self.cfg.scale_embeddings else 0.0

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits in its dtype, soft-capped where the family caps them (Gemma 2): every caller
        that scores the target's tokens reads them here."""
        return soft_cap(self.lm_head(hidden), self.cfg.logit_softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
