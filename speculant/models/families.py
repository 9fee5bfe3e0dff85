"""What each model family changes in the decoder, in one place: the layer stack (llama.py), the checkpoint
readers (loader.py, gguf.py, gguf_native.py) and the native kernels' eligibility read these entries, never a
family's name.

A new family is an entry here, plus layer code only for a form no entry has yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    model_type: str
    architectures: tuple[str, ...]  # Hugging Face `architectures` entries that name it
    # transformers' config class for it: the defaults of every key a config.json leaves out (model_config.py).
    config_class: str
    gguf: str | None = None  # its GGUF files' general.architecture
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's checkpoints store weight − 1
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False  # the token embeddings times √hidden
    sandwich_norms: bool = False  # a norm after attention and after the MLP as well as before each (Gemma 2, 3)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    qkv_bias: bool = False
    fused_checkpoint: bool = False  # q, k, v and gate, up stored as one tensor each (loader.split_fused)
    window_by_default: bool = False  # config `sliding_window` applies unless `use_sliding_window` says no
    # Every n-th layer global, the others sliding, where neither the config nor its class (older transformers)
    # lists `layer_types`; Gemma 2's own config.json files state neither the types nor a pattern.
    sliding_pattern: int | None = None
    permuted_qk: bool = False  # llama.cpp's converter interleaved each head's q/k rows (GGUF)
    # The MLP of its routed layers is a mixture of experts (models/moe.py), and how the router picks and weighs
    # them: moe.SOFTMAX_TOPK or moe.TOPK_SOFTMAX; None: a dense model.
    routing: str | None = None
    # GGUF block tensors whose Hugging Face name differs from the Llama mapping (gguf.BLOCK_NAMES).
    gguf_names: dict[str, str] = field(default_factory=dict)
    # gguf.py fills these in a converted config from llama.cpp's fixed choices for the family.
    gguf_defaults: dict = field(default_factory=dict)
    # The layer count of the size whose GGUF scores llama.cpp scales by hidden / heads, not head_dim (27B).
    gguf_width_scaled_layers: int | None = None
    # Hybrid models (Qwen3.5, Qwen3-Next): the layers config `layer_types` calls linear_attention are Gated
    # DeltaNet (models/gdn.py), the others gated attention (q_proj emits a sigmoid gate per head).
    linear_attention: bool = False
    # Qwen3-Next stores the DeltaNet projections fused per key head (in_proj_qkvz, in_proj_ba; loader.py).
    grouped_linear_checkpoint: bool = False
    # llama.cpp's converter reorders the DeltaNet value heads from grouped by key head to tiled (qwen35, qwen35moe).
    gguf_tiled_value_heads: bool = False
    # gpt-oss: a learned sink logit per head in every softmax of attention (attention.attend), a bias on o_proj
    # too, biases on the router and the experts, whose SwiGLU is clamped (`swiglu_limit`) and stored with gate and
    # up interleaved, transposed and stacked (moe.expert_state).
    attention_sinks: bool = False
    output_bias: bool = False
    expert_bias: bool = False
    # The GGUF block tensors every layer must have, where they are not the Llama family's (gguf.REQUIRED_BLOCK).
    gguf_block: tuple[str, ...] = ()
    # gguf.py merges these into a converted config's rope_scaling (llama.cpp's files state only type, factor and
    # the pretrained context).
    gguf_rope_scaling: dict = field(default_factory=dict)
    # Gemma 4: a weightless norm on v, each layer's output times its `layer_scalar`, scores unscaled (1.0).
    value_norm: bool = False
    layer_scalar: bool = False
    query_scale: float | None = None
    # The GGUF architecture whose tokenizer transformers' reader takes for this family's files, where it refuses
    # the family's own (the tokenizer fields are the same).
    gguf_tokenizer_as: str | None = None


GEMMA_GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), "LlamaConfig", "llama", permuted_qk=True),
    Family("mistral", ("MistralForCausalLM",), "MistralConfig", "mistral", window_by_default=True,
           permuted_qk=True),
    Family("qwen2", ("Qwen2ForCausalLM",), "Qwen2Config", "qwen2", qkv_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), "Qwen3Config", "qwen3", qk_norm=True),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "Qwen3MoeConfig", "qwen3moe", qk_norm=True,
           routing="softmax_topk"),
    # llama.cpp writes Mixtral as a "llama" GGUF with experts (GGUF_EXPERTS).
    Family("mixtral", ("MixtralForCausalLM",), "MixtralConfig", window_by_default=True, permuted_qk=True,
           routing="topk_softmax"),
    # llama.cpp keeps Phi-3's fused tensors: attn_qkv, and ffn_up holding gate and up.
    # Phi-3's attention honours `sliding_window` whenever the config states one (Phi-3-mini: 2047).
    Family("phi3", ("Phi3ForCausalLM",), "Phi3Config", "phi3", fused_checkpoint=True, window_by_default=True,
           gguf_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    # Gemma 2's attention scores and logits are soft-capped (config attn_logit_softcapping,
    # final_logit_softcapping; llama.cpp's 50 and 30 where a GGUF states none, and its window 4096). Even layers
    # slide, as in llama.cpp; its norms already hold 1 + w.
    Family("gemma2", ("Gemma2ForCausalLM",), "Gemma2Config", "gemma2", norm_offset=1.0, activation="gelu_tanh",
           scale_embeddings=True, sandwich_norms=True, window_by_default=True, sliding_pattern=2,
           gguf_names=GEMMA_GGUF_NAMES, gguf_width_scaled_layers=46,
           gguf_defaults={"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # llama.cpp fixes Gemma 3's local layers (5 of every 6) and their RoPE base; its norms already hold 1 + w.
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "Gemma3TextConfig", "gemma3",
           norm_offset=1.0, activation="gelu_tanh", scale_embeddings=True, sandwich_norms=True, qk_norm=True,
           window_by_default=True, sliding_pattern=6, gguf_names=GEMMA_GGUF_NAMES,
           gguf_width_scaled_layers=62, gguf_defaults={"rope_local_base_freq": 10000.0}),
    # SmolLM3: Llama with every layer `no_rope_layers` marks 0 unrotated (llama.cpp fixes every fourth).
    Family("smollm3", ("SmolLM3ForCausalLM",), "SmolLM3Config", "smollm3", permuted_qk=True,
           gguf_tokenizer_as="llama"),
)
# llama.cpp's names for the hybrid layers (gguf.LINEAR_PARAMS: the two that are no module's weight); a norm after
# attention is the MLP's input norm; the shared expert and its gate (`_shexp`).
HYBRID_GGUF_NAMES = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                     "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                     "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
                     "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
                     "post_attention_norm": "post_attention_layernorm",
                     "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                     "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
QWEN35 = dict(norm_offset=1.0, qk_norm=True, linear_attention=True, gguf_names=HYBRID_GGUF_NAMES)
FAMILIES += (
    Family("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), "Qwen3_5TextConfig", "qwen35",
           gguf_tiled_value_heads=True, **QWEN35),
    # Every layer routed, each with a shared expert beside the routed ones (moe.MoE.shared_expert).
    Family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), "Qwen3_5MoeTextConfig",
           "qwen35moe", routing="softmax_topk", gguf_tiled_value_heads=True, **QWEN35),
    Family("qwen3_next", ("Qwen3NextForCausalLM",), "Qwen3NextConfig", "qwen3next", routing="softmax_topk",
           grouped_linear_checkpoint=True, gguf_tokenizer_as="qwen3", **QWEN35),
)
# gpt-oss: every layer routed (softmax over the top 4 logits), sliding and full layers alternating, YaRN RoPE.
# Its GGUF files (`gpt-oss`) keep the experts MXFP4; transformers' checkpoint leaves YaRN's range untruncated.
FAMILIES += (
    Family("gpt_oss", ("GptOssForCausalLM",), "GptOssConfig", "gpt-oss", activation="swiglu_clamped",
           window_by_default=True, routing="topk_softmax", qkv_bias=True, attention_sinks=True, output_bias=True,
           expert_bias=True, gguf_tokenizer_as="llama",
           gguf_names={"post_attention_norm": "post_attention_layernorm"},
           gguf_block=("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "post_attention_norm", "attn_sinks"),
           gguf_rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
)
# Gemma 4 (text): norms scale by w (no offset), global layers with their own head size (`per_layer_config`) and
# proportional RoPE on a share of their angles; per-layer embeddings and KV sharing read from the config; with
# `enable_moe_block` (26B-A4B) routed experts beside every layer's MLP (moe.SCALED_SOFTMAX_TOPK).
FAMILIES += (
    Family("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), "Gemma4TextConfig", "gemma4",
           activation="gelu_tanh", scale_embeddings=True, sandwich_norms=True, qk_norm=True, window_by_default=True,
           value_norm=True, layer_scalar=True, query_scale=1.0, routing="scaled_softmax_topk",
           gguf_tokenizer_as="llama", gguf_block=("attn_q", "attn_output", "attn_q_norm", "attn_norm"),
           gguf_names={**GEMMA_GGUF_NAMES, "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                       "post_norm": "post_per_layer_input_norm"}),
)
BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
BY_MODEL_TYPE["gemma3_text"] = BY_MODEL_TYPE["gemma3"]
BY_MODEL_TYPE["gemma4_text"] = BY_MODEL_TYPE["gemma4"]
BY_MODEL_TYPE["qwen3_5_text"] = BY_MODEL_TYPE["qwen3_5"]
BY_MODEL_TYPE["qwen3_5_moe_text"] = BY_MODEL_TYPE["qwen3_5_moe"]
BY_GGUF = {f.gguf: f for f in FAMILIES if f.gguf}
# A GGUF architecture whose files with routed experts (`{arch}.expert_count`) are another family's.
GGUF_EXPERTS = {"llama": BY_MODEL_TYPE["mixtral"]}


def family_of(architectures: list[str], model_type: str | None) -> Family | None:
    known = [BY_ARCHITECTURE[a] for a in architectures if a in BY_ARCHITECTURE]
    return known[0] if known else BY_MODEL_TYPE.get(model_type or "")
