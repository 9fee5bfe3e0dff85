"""The multi-token-prediction layer a checkpoint carries (Qwen3.5, Qwen3-Next: `mtp.*`), as a drafter.

It reads what an EAGLE head reads, the target's final (post-norm) hidden state at position t and the embedding of
token t+1, and predicts the hidden state at t+1:

    fc([norm_e(embed(x_{t+1})), norm_h(h_t)]) → one full-attention decoder layer with its own KV → norm → lm_head

with the target's own embeddings and lm_head. Longer drafts run the layer again on its own output, as vLLM and
llama.cpp do. The drafting, the catching up on the target's features and the rollback of the layer's KV are the
EAGLE proposer's (eagle.py): only the layer differs.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from speculant.errors import SpeculantError
from speculant.models.attention import prepare_pass
from speculant.models.gguf_file import mtp_state
from speculant.models.kernels import pack_linears
from speculant.models.kv_cache import KVCache
from speculant.models.llama import Block, RMSNorm
from speculant.models.loader import LoadedModel
from speculant.models.model_config import ModelConfig
from speculant.models.moe import expert_state
from speculant.models.rope import Rope, rope_inv_freq
from speculant.proposers.eagle import EagleProposer

PREFIX = "mtp."


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("vocab", None)  # drafts over the whole vocabulary (EagleProposer reads it)
        norm = functools.partial(RMSNorm, cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(), norm()
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.layers = nn.ModuleList([Block(cfg, 0)])
        self.norm = norm()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope = Rope(cfg.rope_scale)

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c, w = self.cfg, self.norm.weight
        return KVCache(1, max_batch, c.n_kv_heads, max_len, c.head_dim, self.dtype, w.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.activations  # set by load_mtp: the target's (the norms of (1 + w) keep fp32, llama.RMSNorm)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                n_new: torch.Tensor | None = None, parents: list[list[int]] | None = None) -> torch.Tensor:
        """embeds, features [B, T, D] → predicted next features [B, T, D] (EagleHead.forward's contract)."""
        fwd = prepare_pass(cache, slots, embeds.shape[1], n_new, self.rope, self.inv_freq, self.dtype,
                           parents=parents)
        x = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(features)), dim=-1)
        x = self.layers[0](self.fc(x), cache, fwd)
        cache.lengths[slots] = fwd.end
        return self.norm(x)


def mtp_config(target: ModelConfig) -> ModelConfig:
    """The MTP layer is shaped as one of the target's full-attention layers (its MLP routed where the target's are)."""
    return replace(target, n_layers=1, linear_layers=(), dense_layers=(), layer_types=None, sliding_window=None,
                   local_rope_theta=None)


def mtp_tensors(target: LoadedModel, source: str | None = None) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under mtp.*: a Hugging Face folder's (the loader leaves them unread) or a GGUF
    file's `nextn` block, the target's own file or `source`, an MTP-only file (convert_hf_to_gguf --mtp)."""
    source = Path(source or target.source).expanduser()
    if not source.exists():
        raise SpeculantError(f"MTP layer file not found: {source}")
    if source.is_file():
        return mtp_state(source)
    index = source / "model.safetensors.index.json"
    files = sorted(source.glob("*.safetensors")) if index.exists() else [source / "model.safetensors"]
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    state[name] = f.get_tensor(name)
    return state


def load_mtp(target: LoadedModel, source: str | None = None) -> MTPHead:
    """The target's MTP layer, from its own checkpoint or from `source` (an MTP-only GGUF beside it)."""
    cfg = target.config
    state = mtp_tensors(target, source)
    where = source or target.source
    if not state:
        stated = f" (its config says mtp_num_hidden_layers {cfg.mtp_layers})" if cfg.mtp_layers else ""
        raise SpeculantError(f"{where}: this checkpoint carries no multi-token-prediction layer (no mtp.* tensors "
                             f"or nextn blocks){stated}: pass method draft_model or ngram")
    fc = state.get("mtp.fc.weight")
    if fc is not None and fc.shape != (cfg.dim, 2 * cfg.dim):
        raise SpeculantError(f"{where}: its MTP layer is for a model of hidden size {fc.shape[0]}, the target's "
                             f"is {cfg.dim}")
    if cfg.mtp_layers > 1:
        raise SpeculantError(f"{where}: {cfg.mtp_layers} MTP layers; Speculant drafts with a checkpoint's "
                             "single MTP layer (every published Qwen3.5 and Qwen3-Next has one)")
    state = {k.removeprefix(PREFIX): v for k, v in expert_state(state).items()}
    with torch.device("meta"):
        head = MTPHead(mtp_config(cfg))
    expected = set(head.state_dict())
    missing = sorted(expected - state.keys())
    if missing:
        raise SpeculantError(f"{where}: the MTP layer lacks {', '.join(PREFIX + m for m in missing[:4])}")
    head.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
    model = target.model
    head = head.to(device=model.device, dtype=model.dtype)
    head.activations = model.dtype
    head.inv_freq = rope_inv_freq(head.cfg).to(model.device)  # fp32 whatever the weights' dtype
    head = pack_linears(head.eval().requires_grad_(False))
    fill_mtp = getattr(model, "fill_mtp", None)
    if fill_mtp is not None and source is None:  # a GGUF target on its own blocks: the layer's products on them too
        fill_mtp(head)
    return head


class MTPProposer(EagleProposer):
    name = "mtp"

    def __init__(self, head: MTPHead, target, max_batch_size: int, max_len: int):
        super().__init__(head, target, max_batch_size, max_len)
        self.name = "mtp"
