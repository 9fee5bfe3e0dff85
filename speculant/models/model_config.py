"""A checkpoint's config.json read into ModelConfig: what the decoder (llama.py) builds from, for every family
(families.py), with Hugging Face's names."""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import math
import os
import warnings
from dataclasses import dataclass

from speculant.errors import SpeculantError
from speculant.models.families import FAMILIES, Family, family_of

SUPPORTED_ARCHITECTURES = {a: f.model_type for f in FAMILIES for a in f.architectures}
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types
LINEAR = "linear_attention"  # a Gated DeltaNet layer of a hybrid model (gdn.py)


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
    nope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated at all (SmolLM3's NoPE layers)
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
    shared_expert_size: int = 0  # a shared expert beside the routed ones, gated by σ (Qwen3.5-MoE, Qwen3-Next)
    # Hybrid models: the Gated DeltaNet layers (gdn.py) and their shape; the other layers' attention output is
    # gated per head (attention_gate).
    linear_layers: tuple[int, ...] = ()
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    attention_gate: bool = False
    # The value heads in tiled order (head j reads key head j mod k_heads: llama.cpp's converter), else grouped.
    linear_heads_tiled: bool = False
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint carries (proposers/mtp.py)
    # gpt-oss (families.Family): a sink logit per head, o_proj's bias, the router's, the clamped SwiGLU's constants.
    attention_sinks: bool = False
    o_bias: bool = False
    router_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gemma 4 (families.Family): per-layer head sizes and KV heads where layers differ (None: head_dim, n_kv_heads
    # everywhere); the layer whose keys and values each layer reads (its own, or a KV-shared layer's source); the
    # per-layer embeddings' width and vocabulary; k = v on global layers; shared layers' MLP twice as wide.
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    kv_source: tuple[int, ...] = ()
    ple_dim: int = 0
    ple_vocab: int = 0
    k_eq_v: bool = False
    double_wide_shared_mlp: bool = False
    value_norm: bool = False
    layer_scalar: bool = False
    moe_beside_mlp: bool = False  # the routed experts run beside each layer's dense MLP, not in its place (Gemma 4)

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
        # The size every published config states; any other key may be left at the family's default.
        required = ("hidden_size", "num_hidden_layers") + (() if family.model_type == "qwen3_5_moe" else
                                                          ("intermediate_size",))
        missing = [k for k in required if cfg.get(k) is None]
        if missing:
            raise SpeculantError(f"{source}: missing required key(s): {', '.join(missing)}.")
        mtp_layers = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
        cfg = with_family_defaults(cfg, family, source)
        n_heads = cfg["num_attention_heads"]
        rope, local_rope = rope_parameters(cfg)
        if local_rope.get("rope_type", "default") != "default":
            raise SpeculantError(f"{source}: scaled RoPE on the sliding layers ('{local_rope['rope_type']}') is "
                                 "not supported")
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        max_positions, rope_scale = cfg["max_position_embeddings"], 1.0
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3", "longrope", "linear", "yarn", "proportional"):
                raise SpeculantError(f"{source}: unsupported rope_scaling type '{kind}' (supported: llama3, "
                                     "longrope, linear, yarn).")
            if kind == "default":
                scaling = None
            elif kind == "proportional":  # Gemma 4's global layers: the first angles rotate, the rest stay
                scaling = {"rope_type": "proportional", "factor": float(scaling.get("factor") or 1.0),
                           "partial_rotary_factor": float(scaling.get("partial_rotary_factor") or 1.0)}
            elif kind == "yarn":
                scaling, rope_scale = yarn(cfg, scaling, source)
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
        rotary_dim = None if (scaling or {}).get("rope_type") == "proportional" else \
            partial_rotary_dim(cfg, rope, scaling or {}, head_dim, source)
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
            intermediate_size=cfg.get("intermediate_size") or 0,
            norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg.get("rope_theta") or rope["rope_theta"],
            max_position_embeddings=max_positions,
            rope_scaling=scaling,
            rope_scale=rope_scale,
            rotary_dim=rotary_dim,
            tie_embeddings=bool(cfg["tie_word_embeddings"]),
            qkv_bias=bool(cfg.get("attention_bias") or family.qkv_bias),
            mlp_bias=bool(cfg.get("mlp_bias", False) or family.expert_bias),
            qk_norm=family.qk_norm,
            sliding_window=sliding,
            norm_offset=offset,
            activation=family.activation,
            scale_embeddings=family.scale_embeddings,
            sandwich_norms=family.sandwich_norms,
            layer_types=tuple(layer_types) if layer_types and sliding and SLIDING in layer_types else None,
            local_rope_theta=cfg.get("rope_local_base_freq") or local_rope.get("rope_theta"),
            query_scale=family.query_scale if scalar is None or scalar == head_dim else scalar ** -0.5,
            attn_softcap=cfg.get("attn_logit_softcapping"),
            logit_softcap=cfg.get("final_logit_softcapping"),
            n_experts=n_experts,
            experts_per_token=(cfg.get("num_experts_per_tok") or cfg.get("top_k_experts")) if n_experts else 0,
            expert_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if n_experts else 0,
            routing=family.routing if n_experts else None,
            # Qwen3.5-MoE's router renormalises always (its config has no norm_topk_prob).
            renormalise=bool(cfg.get("norm_topk_prob", family.linear_attention)),
            dense_layers=dense_layers if n_experts else (),
            shared_expert_size=(cfg.get("shared_expert_intermediate_size") or 0) if n_experts else 0,
            **hybrid_shape(cfg, family),
            mtp_layers=mtp_layers,
            nope_layers=tuple(i for i, r in enumerate(cfg.get("no_rope_layers") or []) if not r),
            attention_sinks=family.attention_sinks,
            o_bias=family.output_bias and bool(cfg.get("attention_bias", True)),
            router_bias=family.expert_bias,
            swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
            swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
            **gemma4_shape(cfg, family, head_dim, layer_types),
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

    def linear(self, layer: int) -> bool:
        """Whether layer `layer` is Gated DeltaNet (gdn.py) rather than attention."""
        return layer in self.linear_layers

    def kind(self, layer: int) -> str:
        return self.attention_kinds[0] if self.layer_types is None else self.layer_types[layer]

    def head_dim_of(self, layer: int) -> int:
        return self.head_dim if self.layer_head_dims is None else self.layer_head_dims[layer]

    def kv_heads_of(self, layer: int) -> int:
        return self.n_kv_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]

    def kind_head_dim(self, kind: str) -> int:
        """The head size of layers of `kind` (a pass's rotary tables are that wide)."""
        return next((self.head_dim_of(i) for i in range(self.n_layers) if self.kind(i) == kind), self.head_dim)

    def shared(self, layer: int) -> bool:
        """Whether layer `layer` reads an earlier layer's keys and values and keeps none of its own (Gemma 4)."""
        return bool(self.kv_source) and self.kv_source[layer] != layer

    @property
    def cache_layers(self) -> list[int]:
        """The attention layers that keep keys and values in the cache, in cache order."""
        return [i for i in range(self.n_layers) if not self.linear(i) and not self.shared(i)]


def hybrid_shape(cfg: dict, family: Family) -> dict:
    """The ModelConfig fields of a hybrid family's Gated DeltaNet layers (none for other families)."""
    if not family.linear_attention:
        return {}
    types = cfg.get("layer_types") or []
    return dict(linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
                linear_k_heads=cfg["linear_num_key_heads"], linear_v_heads=cfg["linear_num_value_heads"],
                linear_k_dim=cfg["linear_key_head_dim"], linear_v_dim=cfg["linear_value_head_dim"],
                conv_kernel=cfg["linear_conv_kernel_dim"], attention_gate=True,
                linear_heads_tiled=bool(cfg.get("linear_value_heads_tiled")))


def with_family_defaults(cfg: dict, family: Family, source: str) -> dict:
    """`cfg` with each key it leaves out at the family's own default, as transformers' config class for the
    family resolves it (publishers write only what differs: Gemma 3's text_config), in that class's names.
    Kept on disk by the config, the class and transformers' version: importing transformers costs a second
    of every load."""
    from speculant.models.gguf_file import cache_dir

    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    key = json.dumps({"class": family.config_class, "transformers": version, "config": cfg}, sort_keys=True,
                     default=repr)
    kept = cache_dir(None) / "configs" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        return json.loads(kept.read_text())
    except (OSError, ValueError):
        pass
    resolved = resolve_with_transformers(cfg, family, source)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f"{kept.name}.{os.getpid()}")
        tmp.write_text(json.dumps(resolved))
        os.replace(tmp, kept)
    except (OSError, TypeError, ValueError):  # a read-only cache, a value JSON cannot hold: resolved each load
        pass
    return resolved


def resolve_with_transformers(cfg: dict, family: Family, source: str) -> dict:
    import transformers

    config_class = getattr(transformers, family.config_class, None)
    if config_class is None:
        raise SpeculantError(f"{source}: {family.model_type} needs transformers' {family.config_class}, which "
                             f"transformers {transformers.__version__} lacks: upgrade transformers")
    given = {k: v for k, v in copy.deepcopy(cfg).items() if k not in ("architectures", "model_type")}
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its advice on its own newer key names is none of the user's
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config_class(**given).to_dict()
    except Exception as e:  # transformers' own checks: a LongRoPE factor list of the wrong length, ...
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise SpeculantError(f"{source}: transformers' {family.config_class} refuses it: {lines[-1].strip()}") \
            from None
    finally:
        transformers.logging.set_verbosity(level)


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


def yarn(cfg: dict, scaling: dict, source: str) -> tuple[dict, float]:
    """YaRN (gpt-oss) → (the scaling rope_inv_freq reads, the attention factor on cos and sin), as transformers'
    _compute_yarn_parameters reads the same keys."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise SpeculantError(f"{source}: yarn needs original_max_position_embeddings")
    factor = scaling.get("factor") or cfg["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if attention is None:
        attention = get_mscale(mscale) / get_mscale(mscale_all) if mscale and mscale_all else get_mscale()
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
            "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
            "truncate": bool(scaling.get("truncate", True))}, float(attention)


def gemma4_shape(cfg: dict, family: Family, head_dim: int, layer_types: list[str] | None) -> dict:
    """Gemma 4's ModelConfig fields: per-layer head sizes and KV heads (`per_layer_config`, keyed by layer), KV
    sharing (the last `num_kv_shared_layers` read the last earlier layer of their type, as transformers'
    kv_sharing_modes), the per-layer embeddings and attention_k_eq_v."""
    if not family.value_norm:
        return {}
    n = cfg["num_hidden_layers"]
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not per_layer and cfg.get("global_head_dim"):
        per_layer = {i: {"head_dim": cfg["global_head_dim"]} for i, t in enumerate(layer_types or []) if t == FULL}
    dims = tuple(per_layer.get(i, {}).get("head_dim") or head_dim for i in range(n))
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    heads = tuple(per_layer.get(i, {}).get("num_key_value_heads") or kv for i in range(n))
    shared, types = int(cfg.get("num_kv_shared_layers") or 0), list(layer_types or [FULL] * n)
    first = n - shared
    source = tuple(i if i < first else max(j for j in range(first) if types[j] == types[i]) for i in range(n))
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    return dict(layer_head_dims=dims if len(set(dims)) > 1 else None,
                layer_kv_heads=heads if len(set(heads)) > 1 else None, kv_source=source if shared else (),
                ple_dim=ple, ple_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if ple else 0,
                k_eq_v=bool(cfg.get("attention_k_eq_v")), double_wide_shared_mlp=bool(cfg.get("use_double_wide_mlp")),
                value_norm=True, layer_scalar=family.layer_scalar, moe_beside_mlp=bool(cfg.get("enable_moe_block")))
