"""EAGLE-3 heads as published (Li et al., 2025): one loader for the three config dialects, the head, its proposer.

An EAGLE-3 head reads, at position t, the embedding of token t+1 and the target's hidden states entering three
of its layers at t, fused by `fc` [H, 3·H_target] into one vector; its one decoder layer attends over the 2H
concatenation [input_layernorm(embedding); hidden_norm(fused)] and adds the (fused) residual. Its output, before
its final norm, is what it reads next when it drafts on from its own guesses; under the norm, its own lm_head
scores a reduced draft vocabulary: draft id i is target id i + d2t[i].

Dialects (all read by `read_config`, whichever the folder holds):
- SpecForge / SGLang: a flat Llama config, `architectures` LlamaForCausalLMEagle3 or Eagle3LlamaForCausalLM,
  `num_hidden_layers` 1, `draft_vocab_size`, optional `target_hidden_size`; tensors under `midlayer.`;
- vLLM speculators: `Eagle3Speculator` / `Eagle3DraftModel`, the layer's shape in `transformer_layer_config`,
  flags at the top (`eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, `norm_before_fc`, `fc_norm`,
  `norm_output`), `target_hidden_size` null when it equals the head's; tensors under `layers.0.`;
- NVIDIA ModelOpt: the flat config with the EAGLE fields nested in `eagle_config`.

Fused layers: the config's ids, else vLLM's default (2, N//2, N−3), each read as the hidden state entering that
layer (id N: the last layer's output before the final norm): Transformer.forward(capture=…). The ids circulate in
two conventions and the wrong one fails silently (acceptance collapses): the top-level key (vLLM's) names a layer's
input, `eagle_config`'s (SGLang, ModelOpt) the layer whose output is read (SGLang captures id + 1). Each is read
and written in its own; tests/proposers/test_eagle3.py pins both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from speculant.errors import SpeculantError
from speculant.models.attention import prepare_pass
from speculant.models.kernels import pack_linears
from speculant.models.kv_cache import KVCache
from speculant.models.llama import MLP, Attention, RMSNorm, Transformer
from speculant.models.loader import LoadedModel
from speculant.models.model_config import ModelConfig
from speculant.models.rope import Rope, rope_inv_freq
from speculant.prefix_cache import PrefixCache
from speculant.proposers.base import TargetHidden
from speculant.proposers.eagle import EagleProposer
from speculant.sequence import Sequence

CONFIG, WEIGHTS = "config.json", "model.safetensors"
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
DIALECTS = ("specforge", "speculators", "modelopt")
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "attention_bias", "mlp_bias",
              "hidden_act")


@dataclass
class Eagle3Config:
    """What a head's config says, whatever its dialect."""

    layer: dict  # the decoder layer's Llama config (Hugging Face keys)
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: list[int] | None  # None: the default (2, N//2, N−3) of the target's N layers
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per fused layer before fc
    norm_output: bool = False  # EAGLE 3.1: the head reads its normed output next, not the pre-norm one
    dialect: str = "specforge"

    @property
    def model_config(self) -> ModelConfig:
        hf = {**self.layer, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
              "vocab_size": self.vocab_size}
        return ModelConfig.from_hf(hf, "EAGLE-3 head config")


def default_aux_layers(n_layers: int) -> list[int]:
    """vLLM's and SafeAILab's default: early, middle and late features."""
    return [2, n_layers // 2, n_layers - 3]


def from_layer_outputs(ids: list[int]) -> list[int]:
    """eagle_config's ids (SGLang, ModelOpt: the output of layer i) → this module's (the input of layer i + 1)."""
    return [int(i) + 1 for i in ids]


def to_layer_outputs(aux: list[int]) -> list[int]:
    """This module's ids → eagle_config's: a head saved here reads, in SGLang, the layers it was trained on."""
    return [int(i) - 1 for i in aux]


def read_aux_layers(raw: dict, eagle: dict) -> list[int] | None:
    """The fused layers as this module counts them; the top-level key (vLLM's, a layer's input) first, as vLLM
    reads it, else eagle_config's (a layer's output)."""
    if raw.get(AUX_KEY) is not None:
        return [int(i) for i in raw[AUX_KEY]]
    return None if eagle.get(AUX_KEY) is None else from_layer_outputs(eagle[AUX_KEY])


def read_config(raw: dict, where: str = CONFIG) -> Eagle3Config:
    """A head's config.json in any of the three dialects → Eagle3Config (SpeculantError, one line, otherwise)."""
    archs = raw.get("architectures") or []
    nested = raw.get("transformer_layer_config")
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if isinstance(nested, dict) or any(a in SPECULATORS_ARCHITECTURES for a in archs):
        dialect, layer_src = "speculators", nested if isinstance(nested, dict) else raw
    elif any(a in SPECFORGE_ARCHITECTURES for a in archs):
        dialect, layer_src = ("modelopt" if "use_aux_hidden_state" in eagle else "specforge"), raw
    else:
        raise SpeculantError(f"{where}: not an EAGLE-3 head (architectures {archs or 'missing'}; expected one of "
                             f"{', '.join(SPECFORGE_ARCHITECTURES + SPECULATORS_ARCHITECTURES)})")
    if eagle.get("use_aux_hidden_state") is False:
        raise SpeculantError(f"{where}: eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 head, not EAGLE-3")
    if (layer_src.get("num_hidden_layers") or 1) != 1:
        raise SpeculantError(f"{where}: EAGLE-3 heads of {layer_src['num_hidden_layers']} layers are not supported "
                             "(one)")

    def flag(name: str, default=None):
        # ModelOpt nests them in eagle_config (vLLM PR 42143 read norm_before_fc from there); the others at the top.
        return eagle.get(name, raw.get(name, default))

    layer = {k: layer_src[k] for k in LAYER_KEYS if layer_src.get(k) is not None}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in layer]
    vocab = layer_src.get("vocab_size") or raw.get("vocab_size")
    if missing or vocab is None:
        raise SpeculantError(f"{where}: missing {', '.join(missing + ['vocab_size'] * (vocab is None))}")
    aux = read_aux_layers(raw, eagle)
    return Eagle3Config(
        layer=layer, vocab_size=int(vocab), draft_vocab_size=int(flag("draft_vocab_size") or vocab),
        target_hidden_size=int(flag("target_hidden_size") or layer["hidden_size"]),
        aux_layers=aux,
        norm_before_residual=bool(flag("norm_before_residual", False)),
        norm_before_fc=bool(flag("norm_before_fc", False)), fc_norm=bool(flag("fc_norm", False)),
        norm_output=bool(flag("norm_output", False)), dialect=dialect)


def canonical_name(name: str) -> str:
    """A tensor's name as this module stores it: without a `model.` prefix, the layer as `midlayer.`."""
    for prefix in ("model.", "eagle_module."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


# -- the head ------------------------------------------------------------------------------------


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [input_layernorm(embedding); hidden_norm(hidden)] (2H wide),
    the residual the hidden state (normed first with norm_before_residual), then the MLP."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, 0)
        self.self_attn.qkv_proj = nn.Linear(2 * cfg.dim, self.self_attn.qkv_proj.out_features, bias=cfg.qkv_bias)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache, fwd) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(torch.cat((self.input_layernorm(embeds), normed), dim=-1), cache, fwd)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """fc(target features) or its own output → Eagle3Layer → (norm → lm_head over the draft vocabulary)."""

    def __init__(self, config: Eagle3Config, aux_layers: list[int], own_embeddings: bool = False):
        super().__init__()
        self.config, self.aux_layers = config, tuple(aux_layers)
        cfg = self.cfg = config.model_config
        wide = len(aux_layers) * config.target_hidden_size
        self.input_norm = RMSNorm(wide, cfg.norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, cfg.norm_eps) for _ in aux_layers) \
            if config.fc_norm else None
        self.fc = nn.Linear(wide, cfg.dim, bias=False)
        self.midlayer = Eagle3Layer(cfg, config.norm_before_residual)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, cfg.dim) if own_embeddings else None
        # Draft id i is target id i + d2t[i] (offsets, as SpecForge and vLLM store them); t2d marks the target ids
        # the draft vocabulary holds.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope = Rope()

    @property
    def vocab(self) -> torch.Tensor | None:
        """The target ids of the draft vocabulary (None: the whole vocabulary, in order): what EagleProposer
        draws from."""
        key = (self.d2t.data_ptr(), self.d2t.device, self.d2t._version)  # read at every draft: computed once
        if getattr(self, "_vocab_key", None) != key:
            ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
            whole = len(ids) == self.config.vocab_size and not bool(self.d2t.any())
            self._vocab_key, self._vocab = key, None if whole else ids
        return self._vocab

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c, w = self.cfg, self.norm.weight
        return KVCache(1, max_batch, c.n_kv_heads, max_len, c.head_dim, w.dtype, w.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's captured features [.., n·H_target] → the head's hidden [.., H]."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                n_new: torch.Tensor | None = None, parents: list[list[int]] | None = None) -> torch.Tensor:
        """embeds [B, T, H] and hidden: the target's features [B, T, n·H_target] (fused by fc) or the head's own
        output [B, T, H] → the head's output [B, T, H] (read next and by `logits`); appends to the cache rows
        `slots` as EagleHead.forward does."""
        dtype = self.norm.weight.dtype
        fwd = prepare_pass(cache, slots, embeds.shape[1], n_new, self.rope, self.inv_freq, dtype, parents=parents)
        hidden = hidden.to(dtype)
        if hidden.shape[-1] != self.cfg.dim:
            hidden = self.fuse(hidden)
        x = self.midlayer(embeds.to(dtype), hidden, cache, fwd)
        cache.lengths[slots] = fwd.end
        return self.norm(x) if self.config.norm_output else x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output → logits over the draft vocabulary."""
        return self.lm_head(out if self.config.norm_output else self.norm(out))


# -- loading and saving --------------------------------------------------------------------------


def load_eagle3(folder: str | Path, target: LoadedModel) -> Eagle3Head:
    """A published EAGLE-3 head folder (config.json + *.safetensors, any dialect) for `target`; refused with one
    line where it does not fit the target (its fused layers, feature width, vocabulary)."""
    folder = Path(folder).expanduser()
    if not (folder / CONFIG).exists():
        raise SpeculantError(f"{folder}: an EAGLE-3 head folder needs {CONFIG} and its *.safetensors")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpeculantError(f"{folder}: no *.safetensors weights (pickled .bin files are not loaded)")
    config = read_config(json.loads((folder / CONFIG).read_text()), str(folder / CONFIG))
    state = {}
    for f in files:
        state.update({canonical_name(k): v for k, v in load_file(str(f)).items()})
    t = target.config
    aux = config.aux_layers if config.aux_layers is not None else default_aux_layers(t.n_layers)
    check_fits(config, aux, state, target, folder)
    own = "embed_tokens.weight" in state
    with torch.device("meta"):
        head = Eagle3Head(config, aux, own)
    state.setdefault("t2d", torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(
        0, torch.arange(config.draft_vocab_size) + state.get("d2t", torch.zeros(config.draft_vocab_size,
                                                                                 dtype=torch.long)), True))
    state.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    unknown = sorted(set(state) - set(head.state_dict()))
    if unknown:
        raise SpeculantError(f"{folder}: tensors this EAGLE-3 head has no place for: {', '.join(unknown[:4])}")
    head.load_state_dict(state, assign=True, strict=False)
    missing = [k for k, v in head.state_dict().items() if v.is_meta]
    if missing:
        raise SpeculantError(f"{folder}: the head's weights lack {', '.join(missing[:4])}")
    head.inv_freq = rope_inv_freq(head.cfg)
    model = target.model
    return pack_linears(head.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False))


def check_fits(config: Eagle3Config, aux: list[int], state: dict, target: LoadedModel, folder: Path) -> None:
    """Refuse, in one line, a head whose fused layers or vocabulary do not fit the target."""
    t = target.config
    why = None
    fc = state.get("fc.weight")
    if any(not 0 <= i <= t.n_layers for i in aux):
        why = (f"its fused layers {aux} are not layers of the target's {t.n_layers} (ids 0..{t.n_layers}, the "
               "hidden state entering each)")
    elif config.target_hidden_size != t.dim:
        why = f"it reads features of width {config.target_hidden_size}, the target's hidden size is {t.dim}"
    elif fc is None or tuple(fc.shape) != (config.model_config.dim, len(aux) * t.dim):
        why = (f"its fc.weight is {None if fc is None else list(fc.shape)}, not [{config.model_config.dim}, "
               f"{len(aux)}·{t.dim}] for {len(aux)} fused layers of width {t.dim}")
    elif len(aux) * t.dim == config.model_config.dim:
        why = "its fused width equals its own hidden size, which this loader cannot tell apart"
    elif config.vocab_size != t.vocab_size:
        why = f"its vocabulary has {config.vocab_size} tokens, the target's {t.vocab_size}"
    elif "embed_tokens.weight" not in state and config.model_config.dim != t.dim:
        why = f"it has no embed_tokens and its hidden size {config.model_config.dim} is not the target's {t.dim}"
    else:
        why = vocab_mismatch(config, state)
    if why:
        raise SpeculantError(f"{folder}: this EAGLE-3 head does not fit the target '{Path(target.source).name}': "
                             f"{why}")


def vocab_mismatch(config: Eagle3Config, state: dict) -> str | None:
    n, V = config.draft_vocab_size, config.vocab_size
    head, d2t, t2d = state.get("lm_head.weight"), state.get("d2t"), state.get("t2d")
    if head is None or head.shape[0] != n:
        return f"its lm_head has {None if head is None else head.shape[0]} rows, its draft_vocab_size is {n}"
    if d2t is None:
        return None if n == V else f"its draft vocabulary of {n} tokens has no d2t"
    if d2t.shape != (n,):
        return f"its d2t has shape {list(d2t.shape)}, not [{n}]"
    ids = torch.arange(n) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= V or len(set(ids.tolist())) != n:
        return f"its d2t offsets map draft ids outside the target's {V} tokens (or twice to one)"
    if t2d is not None and (t2d.shape != (V,) or not bool(t2d.bool()[ids].all()) or int(t2d.bool().sum()) != n):
        return "its t2d does not mark exactly the target ids its d2t maps to"
    return None


def save_eagle3(head: Eagle3Head, folder: Path, dialect: str = "specforge", dtype: torch.dtype = torch.bfloat16,
                extra: dict | None = None) -> None:
    """config.json + model.safetensors in one of DIALECTS (SpecForge's by default: vLLM and SGLang load it)."""
    if dialect not in DIALECTS:
        raise ValueError(f"dialect {dialect!r}; one of {DIALECTS}")
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    state = {}
    for k, v in head.state_dict().items():
        name = "layers.0." + k[len("midlayer."):] if dialect == "speculators" and k.startswith("midlayer.") else k
        state[name] = v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().cpu()
    state = split_fused(state, head.cfg)
    layer = {**c.layer, "num_hidden_layers": 1, "vocab_size": c.vocab_size}
    aux = list(head.aux_layers)
    flags = {"norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
             "fc_norm": c.fc_norm, "norm_output": c.norm_output}
    torch_dtype = str(dtype).removeprefix("torch.")
    if dialect == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": {"model_type": "llama", **layer}, "draft_vocab_size": c.draft_vocab_size,
                  "target_hidden_size": None if c.target_hidden_size == layer["hidden_size"] else c.target_hidden_size,
                  AUX_KEY: aux, **flags,
                  "speculators_config": {"algorithm": "eagle3", "verifier": {}}, "torch_dtype": torch_dtype}
    else:
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer,
                  "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
                  "tie_word_embeddings": False, "torch_dtype": torch_dtype}
        if dialect == "modelopt":
            config["eagle_config"] = {AUX_KEY: to_layer_outputs(aux), "use_aux_hidden_state": True, **flags}
        else:
            # SGLang reads eagle_config's ids (layer outputs), vLLM the top level's (layer inputs).
            config.update({"eagle_config": {AUX_KEY: to_layer_outputs(aux)}, AUX_KEY: aux, **flags})
    config.update(extra or {})
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def split_fused(state: dict, cfg: ModelConfig) -> dict:
    """This module's fused qkv_proj and gate_up_proj back to the q/k/v and gate/up tensors published heads hold."""
    out = {}
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for name, t in state.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            base, kind = name.rsplit("qkv_proj.", 1)
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[f"{base}{part}.{kind}"] = piece.contiguous()
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            base, kind = name.rsplit("gate_up_proj.", 1)
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[f"{base}{part}.{kind}"] = piece.contiguous()
        else:
            out[name] = t
    return out


def head_from_target(target_cfg: ModelConfig, aux_layers: list[int], draft_vocab: torch.Tensor | None,
                     **flags) -> Eagle3Head:
    """A new head shaped like one of the target's layers (training, tests), drafting from `draft_vocab` (sorted
    target ids; None: all)."""
    t = target_cfg
    layer = {"hidden_size": t.dim, "intermediate_size": t.intermediate_size, "num_attention_heads": t.n_heads,
             "num_key_value_heads": t.n_kv_heads, "head_dim": t.head_dim, "rms_norm_eps": t.norm_eps,
             "rope_theta": t.rope_theta, "max_position_embeddings": t.max_position_embeddings, "hidden_act": "silu"}
    if t.rope_scaling is not None:
        layer["rope_scaling"] = t.rope_scaling
    n = t.vocab_size if draft_vocab is None else len(draft_vocab)
    config = Eagle3Config(layer=layer, vocab_size=t.vocab_size, draft_vocab_size=n, target_hidden_size=t.dim,
                          aux_layers=list(aux_layers), **flags)
    head = Eagle3Head(config, aux_layers)
    if draft_vocab is not None:
        head.d2t.copy_(draft_vocab - torch.arange(n))
        head.t2d.zero_().index_fill_(0, draft_vocab, True)
    else:
        head.t2d.fill_(True)
    return head


# -- the proposer --------------------------------------------------------------------------------


class Eagle3Proposer(EagleProposer):
    """EagleProposer's bookkeeping, chains and trees over an EAGLE-3 head: the features it holds per sequence are
    the target's captured layers (the runner asks the target for `capture`), fused by the head as it reads them."""

    def __init__(self, head: Eagle3Head, target: Transformer, max_batch_size: int, max_len: int,
                 tree_width: int = 1, max_depth: int = 1):
        super().__init__(head, target, max_batch_size, max_len, tree_width, max_depth)
        self.name = "eagle3+tree" if tree_width > 1 else "eagle3"
        self.capture = head.aux_layers

    # -- prefix caching: the head's own entries of past sequences, as a draft model keeps its keys -----------

    prefix_cache: PrefixCache | None = None
    scratch: KVCache | None = None  # a target row to recompute features the head's cache lacks (released after)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache.row_bytes_per_token

    def use_prefix_cache(self, capacity_bytes: int) -> bool:
        """Keep the head's entries of finished sequences beside the target's keys. Head entry t reads token t+1, so
        an entry set is keyed by one token more than it holds; where the target's cached prefix is longer than the
        head's (another eviction, a running row's shared prompt), the features between are recomputed exactly by a
        target pass over the prefix in a row of its own (commit)."""
        self.prefix_cache = PrefixCache(capacity_bytes)
        self.max_len = self.cache.max_len
        return True

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        if self.prefix_cache is not None:
            rid, slot = seq.request_id, self.slot[seq.request_id]
            n = self.prefix_cache.load(seq.tokens[:-1], self.cache, slot, count=False)
            self.fed[rid] = max(n - 1, 0)
            self.cache.rollback(slot, self.fed[rid])

    def remove(self, seq: Sequence) -> None:
        rid = seq.request_id
        if self.prefix_cache is not None and seq.finished and seq.finish_reason != "error" and self.fed[rid]:
            fed = min(self.fed[rid] + 1, self.cache.max_len)
            self.prefix_cache.store(seq.tokens[:fed], self.cache, self.slot[rid])
        super().remove(seq)

    def commit(self, seqs: list[Sequence], target: TargetHidden) -> None:
        for b, s in enumerate(seqs):
            rid = s.request_id
            known = self.fed.get(rid, 0) + self.n_pending.get(rid, 0)
            if rid in self.slot and target.start[b] > known:
                self.pending[rid].append(self._recompute(s, known, target.start[b]))
                self.n_pending[rid] += target.start[b] - known
        super().commit(seqs, target)

    def _recompute(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """The target's captured features of positions start..end-1 of `seq`, from a pass over its tokens 0..end-1
        in a row of their own: a pass computes a position with the same bits however the prompt was cut."""
        if self.scratch is None or self.scratch.max_len < end:
            self.scratch = self.target.new_cache(1, max(end, self.max_len))
        self.scratch.rollback(0, 0)
        ids = torch.tensor([seq.tokens[:end]], device=self.target.device)
        _, features = self.target(ids, self.scratch, torch.tensor([0], device=self.target.device), capture=self.capture)
        # The row's keys serve this pass only: its pages go back now, not at the next recompute (a long prefix's
        # keys of every target layer would stay taken for the proposer's life).
        self.scratch.release(0)
        return features[0, start:end].to(self.target.dtype)

    def draft_head(self, head: Eagle3Head, target: Transformer):
        return head.logits

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(tokens)
        return self.target.embed(tokens)
