"""The distillation loss every draft kind trains on (a module of its own: train.py and eagle3.py both use it)."""

from __future__ import annotations

import torch


def top_k_kl(logits: torch.Tensor, topk_logprobs: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) restricted to the target's top-k tokens, p renormalised on them (0 when the draft
    matches the target there). logits [N, V], topk [N, K] → mean over N. Ids of -1 (tokens outside
    a draft vocabulary) take no part; a row with none inside counts 0."""
    inside = topk_ids >= 0
    # A row with no token inside would be all -inf: NaN, and NaN times the mask's 0 is NaN in the
    # backward pass. Such rows get plain zeros (they are masked out below).
    p_in = topk_logprobs.float().masked_fill(~inside, -torch.inf).where(inside.any(-1, keepdim=True), 0.0)
    logp = torch.log_softmax(p_in, dim=-1)
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids.clamp(min=0))
    terms = torch.where(inside, logp.exp() * (logp - logq), 0.0)
    return terms.sum(-1).mean()
