"""The EAGLE-3 objective: a head on three of the target's layers, trained with the training-time test.

The frozen target reads each window once (no gradient) and hands the hidden states entering the head's fused
layers (Transformer.forward's capture), so the data set needs no features of its own: the tokens and the target's
top-k next-token log-probabilities the EAGLE pipeline records (data.py) are enough.

Training-time test (Li et al., 2025, as SpecForge trains): step 0 feeds the head the target's fused features;
step j feeds it its own output of step j−1 at the same position, with the token j further on, so entry (t, j) is
what drafting computes for the (j+1)-th draft after position t. Its query attends to the step-0 keys of positions
≤ t (the entries drafting builds from real features) and to the keys of (t, 1..j) (its own earlier drafts), at
rotary position t + j, as in a drafting pass. Loss: KL to the target's top-k distribution over the draft
vocabulary, step j weighted 0.8^j.
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from speculant.models.loader import LoadedModel
from speculant.models.rope import apply_rope, rope_tables
from speculant.proposers.eagle3 import default_aux_layers, head_from_target, save_eagle3
from speculant.training.losses import top_k_kl

if TYPE_CHECKING:
    from speculant.training.train import TrainConfig

STEP_DECAY = 0.8  # EAGLE-3's weight of later training-time-test steps


class Eagle3Objective(nn.Module):
    def __init__(self, target: LoadedModel, cfg: TrainConfig, vocab: torch.Tensor | None,
                 data: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.cfg, self.target_model = cfg, target.model
        t = target.config
        # vLLM's default layers, kept inside 0..N on targets of fewer than 3 layers (tests' tiny ones).
        self.aux = [min(max(i, 0), t.n_layers) for i in default_aux_layers(t.n_layers)]
        self.model = head_from_target(t, self.aux, vocab).float()
        for p in self.model.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        # The target's last layer seeds the head's MLP and norms (its attention reads 2H, its own shape).
        last = target.model.model.layers[-1]
        self.model.midlayer.mlp.load_state_dict(last.mlp.state_dict())
        self.model.midlayer.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
        self.model.norm.weight.data.copy_(target.model.model.norm.weight.float())
        if vocab is not None:  # the target's lm_head rows of the draft vocabulary: a head that starts as the target's
            self.model.lm_head.weight.data.copy_(target.model.lm_head.weight.detach().float()[vocab])
        self.register_buffer("index", None if vocab is None else torch.full(
            (t.vocab_size,), -1, dtype=torch.long).index_copy_(0, vocab, torch.arange(len(vocab))))
        self.sequences = None if data is None else SequenceFeatures(self, data, cfg.feature_cache_gb)

    def trainable(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    @torch.no_grad()
    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's hidden states entering the fused layers [B, T, 3·D], from an inference pass (a KV cache of
        its own: the native kernels read the cache's layout), as drafting will read them."""
        cache = self.target_model.new_cache(len(tokens), tokens.shape[1])
        return self.target_model(tokens, cache, torch.arange(len(tokens), device=tokens.device),
                                 capture=tuple(self.aux))[1].float()

    def window_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The features of a batch's windows [B, T, 3·D], each read in its whole sequence from the first token
        (where the batch says where its windows start; else each window read alone)."""
        if self.sequences is None or "starts" not in batch:
            return self.features(batch["tokens"])
        return self.sequences.windows(batch["starts"].tolist(), batch["valid"].sum(1).tolist(),
                                      batch["tokens"].shape[1])

    def loss(self, batch: dict[str, torch.Tensor], train: bool = True) -> tuple[torch.Tensor, dict]:
        tokens, valid = batch["tokens"], batch["valid"]
        head, T = self.model, tokens.shape[1] - 1
        features = self.window_features(batch)[:, :-1]  # entry t reads feature t and token t+1
        embeds = self.target_model.embed(tokens).float().detach()
        hidden = head.fuse(features)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        total, weights, metrics = 0.0, 0.0, {}
        for j in range(self.cfg.ttt_steps):
            if T - j <= 0:
                break
            # Entry (t, j) reads token t+1+j (zero past the window: masked out) and predicts token t+2+j.
            shifted = torch.zeros_like(embeds[:, 1:])
            shifted[:, :T - j] = embeds[:, 1 + j:]
            out = self.layer(shifted, hidden, keys, values, j)
            logits_at = valid[:, 1 + j:].clone()
            mask = torch.zeros_like(valid[:, 1:])
            mask[:, :T - j] = logits_at
            logits = head.logits(out[mask]).float()
            top_ids = batch["topk_ids"][:, 1 + j:][logits_at]
            draft_ids = top_ids if self.index is None else self.index[top_ids]
            kl = top_k_kl(logits, batch["topk_logprobs"][:, 1 + j:][logits_at], draft_ids)
            w = STEP_DECAY ** j
            total, weights = total + w * kl, weights + w
            top1 = (logits.argmax(-1) == draft_ids[:, 0]).float().mean()
            metrics.update({f"kl{j + 1}": kl.item(), f"top1_{j + 1}": top1.item()})
            hidden = head.norm(out) if head.config.norm_output else out
        return total / weights, metrics

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor, keys: list, values: list, step: int) -> torch.Tensor:
        """The head's layer for training-time-test step `step` over a whole window [B, T, ·] → its output [B, T, H];
        appends the step's keys and values."""
        layer, cfg = self.model.midlayer, self.model.cfg
        B, T, _ = embeds.shape
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat((layer.input_layernorm(embeds), normed), dim=-1)
        attn = layer.self_attn
        qkv = attn.qkv_proj(x).view(B, T, -1, cfg.head_dim)
        cos, sin = rope_tables(self.model.inv_freq, T + step, x.dtype)
        cos, sin = cos[step:step + T][None, :, None], sin[step:step + T][None, :, None]
        q = apply_rope(qkv, cfg.n_heads, cos, sin).transpose(1, 2)  # [B, Hq, T, Dh]
        k = apply_rope(qkv[:, :, cfg.n_heads:], cfg.n_kv_heads, cos, sin).transpose(1, 2)
        v = qkv[:, :, cfg.n_heads + cfg.n_kv_heads:].transpose(1, 2)
        group = cfg.n_heads // cfg.n_kv_heads
        keys.append(k.repeat_interleave(group, dim=1))
        values.append(v.repeat_interleave(group, dim=1))
        scale = cfg.query_scale or cfg.head_dim ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, -torch.inf)]  # real entries ≤ t
        scores += [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # its own drafts (t, 1..step)
        p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = p[..., :T] @ values[0]
        for i, vv in enumerate(values[1:]):
            out = out + p[..., T + i:T + i + 1] * vv
        out = attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        x = residual + out
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def save(self, out: Path, target: LoadedModel, training: dict) -> None:
        """SpecForge's form (config.json + model.safetensors), which vLLM and SGLang load."""
        save_eagle3(self.model, out, "specforge", extra={"speculant_training": {
            k: v for k, v in training.items() if k in ("steps", "epochs", "wall_time_s", "train_tokens")}})


class SequenceFeatures:
    """The target's features of the recorded sequences' windows, each window read with everything before it in
    its sequence: the labels (the target's top-k) were recorded from whole sequences and drafting reads the whole
    context, so a window that starts mid-sequence read alone would teach features the head never sees.

    Sequences are read in fixed groups of GROUP (the same bits whatever order training asks for them, and after a
    resume) and kept while they fit `budget_gb`; past it each batch reads its windows' sequences up to their ends."""

    GROUP = 8

    def __init__(self, objective: Eagle3Objective, data: dict[str, torch.Tensor], budget_gb: float):
        self.objective = objective
        self.tokens, self.offsets = data["tokens"], data["offsets"].tolist()
        width = len(objective.aux) * objective.target_model.cfg.dim
        self.cacheable = len(self.tokens) * width * 4 <= budget_gb * 2 ** 30
        self.kept: dict[int, torch.Tensor] = {}

    def windows(self, starts: list[int], lengths: list[int], T: int) -> torch.Tensor:
        """Features [B, T, 3·D] of the windows (data offset, length); zeros past each window's length."""
        seqs = [bisect_right(self.offsets, s) - 1 for s in starts]
        if self.cacheable:
            for group in sorted({s // self.GROUP for s in seqs} - {s // self.GROUP for s in self.kept}):
                first = group * self.GROUP
                ids = range(first, min(first + self.GROUP, len(self.offsets) - 1))
                self.kept.update(zip(ids, self.read([(self.offsets[i], self.offsets[i + 1]) for i in ids])))
            read = [self.kept[s] for s in seqs]
        else:
            read = self.read([(self.offsets[q], s + n) for q, s, n in zip(seqs, starts, lengths)])
        out = None
        for b, (q, s, n, f) in enumerate(zip(seqs, starts, lengths, read)):
            out = f.new_zeros(len(starts), T, f.shape[-1]) if out is None else out
            at = s - self.offsets[q]
            out[b, :n] = f[at:at + n]
        return out

    def read(self, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The target's features of data[a:b] for each span, read together in one padded pass."""
        device = self.objective.target_model.device
        tokens = torch.zeros(len(spans), max(b - a for a, b in spans), dtype=torch.long)
        for i, (a, b) in enumerate(spans):
            tokens[i, :b - a] = self.tokens[a:b]
        features = self.objective.features(tokens.to(device))
        return [features[i, :b - a].clone() for i, (a, b) in enumerate(spans)]
