"""The acceptance rule (Leviathan et al. 2022; Chen et al. 2023), batched.

For draft token d_j drawn from q_j, with target distribution p_j (both after the request's
transforms): accept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw
from normalize(max(0, p_j - q_j)); when all drafts pass, draw a bonus token from p_{k+1}.
A deterministic proposer (q = None) is the one-hot case: accept with probability p_j(d_j),
on rejection draw from p_j without d_j. Greedy rows arrive here as one-hot p and draw no
randomness, which makes the rule plain greedy verification.
"""

from __future__ import annotations

import torch

from speculant.sampling import sample, uniforms


def verify(draft: torch.Tensor, n_draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (n_accepted [B], next_token [B]).

    draft [B, k] tokens, of which the first n_draft[b] are real in row b;
    p [B, k+1, V] target probabilities at each draft position and after the last;
    q [B, k, V] the distributions the drafts were drawn from, or None (deterministic proposer).
    """
    B, k = draft.shape
    rows = torch.arange(B, device=draft.device)
    real = torch.arange(k, device=draft.device)[None, :] < n_draft[:, None]  # [B, k]
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    if q is None:
        ratio = p_d
    else:
        q_d = q.gather(-1, draft[..., None]).squeeze(-1)
        ratio = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), 0.0)
    accepted = (uniforms(k, generators, draft.device) < ratio) & real
    n_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [B]

    p_next = p[rows, n_accepted]  # [B, V]
    rejected = n_accepted < n_draft
    if k and bool(rejected.any()):
        at = n_accepted.clamp(max=k - 1)
        if q is None:
            residual = p_next.scatter(-1, draft[rows, at][:, None], 0.0)
        else:
            residual = (p_next - q[rows, at]).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # A zero residual only happens when p == q (up to rounding): then p itself is the answer.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return n_accepted, sample(p_next, generators)
