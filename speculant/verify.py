"""The acceptance rule (Leviathan et al. 2022; Chen et al. 2023), batched.

For draft token d_j drawn from q_j, with target distribution p_j (both after the request's
transforms): accept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw
from normalize(max(0, p_j - q_j)); when all drafts pass, draw a bonus token from p_{k+1}.

Deterministic drafts (lookup, the corpus table, a grammar's forced tokens, a draft tree's candidates: q
one-hot) are verified by coupling instead, row by row whatever rows share the step: the target's token t_j
at each position is drawn as plain decoding draws it there (the request's uniform for that position,
sampling.py), and a draft is kept while it equals t_j. A draft is then kept with probability p_j(d_j), and
on a mismatch t_j is a draw from p_j without d_j: the one-hot case of the rule, and at a tree's node, of
recursive rejection over its candidates. And the tokens are the ones plain decoding writes: a seeded
request's output does not change with speculation, nor with the rows beside it.
Greedy rows draw no randomness (t_j is the argmax), which makes this plain greedy verification.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from speculant.models import native
from speculant.sampling import ACCEPT, TOKEN, SamplingBatch, argmax, inverse_cdf, probabilities, sample, uniform

if TYPE_CHECKING:
    from speculant.proposers import Proposal  # a proposer's drafts, which this module verifies


def verify_proposal(proposal: Proposal, logits: torch.Tensor,
                    sb: SamplingBatch) -> tuple[list[list[int]], list[int]]:
    """A step's drafts against the target's logits → (each row's accepted drafts, as indices into its drafts;
    each row's next token)."""
    if proposal.parents is None:
        n_accepted, next_tokens = verify_logits(proposal.tokens, proposal.n_draft, logits, proposal.q, sb,
                                                proposal.by_rule)
        return [list(range(n)) for n in n_accepted], next_tokens
    paths, next_tokens = verify_tree_logits(proposal.tokens, proposal.n_draft, proposal.parents, logits, sb)
    return paths, next_tokens.tolist()


def verify_logits(draft: torch.Tensor, n_draft: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None,
                  sb: SamplingBatch, by_rule: list[bool] | None = None) -> tuple[list[int], list[int]]:
    """Each row's accepted drafts and next token from the target's logits [B, k+1, V] under the batch's
    sampling transforms: sampled rows with drafts drawn from q (`by_rule`, see Proposal.by_rule) by the rule
    (`verify`), every other row by coupling (`follow_chain`) whatever shares its step: deterministic drafts,
    rows without drafts, greedy rows. So those rows write plain decoding's tokens in any batch."""
    counts = n_draft.tolist()
    ruled = rule_rows(q, by_rule, counts, sb)
    accepted, tokens = [0] * len(counts), [0] * len(counts)
    if ruled:
        at = torch.tensor(ruled, device=draft.device) if len(ruled) < len(counts) else slice(None)
        sub = sb.select(ruled)
        n, t = verify(draft[at], n_draft[at], probabilities(logits[at], sub), q[at], sub)
        for b, n_b, t_b in zip(ruled, n.tolist(), t.tolist()):
            accepted[b], tokens[b] = n_b, t_b
    coupled = sorted(set(range(len(counts))) - set(ruled))
    if coupled:
        target = TargetTokens(logits, sb)
        drafts = draft.tolist()
        for b in coupled:
            accepted[b], tokens[b] = follow_chain(drafts[b][:counts[b]], functools.partial(target.at, b))
    return accepted, tokens


def rule_rows(q: torch.Tensor | None, by_rule: list[bool] | None, n_draft: list[int], sb: SamplingBatch) -> list[int]:
    """The rows the acceptance rule verifies: unseeded sampled rows with drafts drawn from q (every such row
    with a draft where by_rule is None). A seeded row's drafts are always coupled (Proposer.draw)."""
    if q is None:
        return []
    return [b for b, (key, n) in enumerate(zip(sb.keys, n_draft))
            if key is not None and n > 0 and (by_rule is None or by_rule[b]) and not sb.is_seeded(b)]


def verify_tree_logits(draft: torch.Tensor, n_draft: torch.Tensor, parents: list[list[int]], logits: torch.Tensor,
                       sb: SamplingBatch) -> tuple[list[list[int]], torch.Tensor]:
    """Draft trees of deterministic candidates (see Proposal.parents) by coupling (`follow_tree`). logits
    [B, k+1, V]: after the last token (0) and after each draft j (j + 1) → (each row's accepted drafts,
    root to leaf, as draft indices; the next token [B])."""
    target = TargetTokens(logits, sb)
    rows = [follow_tree(tokens, tree, n, functools.partial(target.at, b))
            for b, (tokens, tree, n) in enumerate(zip(draft.tolist(), parents, n_draft.tolist()))]
    return [path for path, _ in rows], torch.tensor([token for _, token in rows], device=draft.device)


class TargetTokens:
    """The target's token at a step's positions, each drawn as plain decoding draws it there: from row b's
    logits at a column (0: after the last token, j + 1: after draft j) with the request's uniform for
    the position `offset` past its next token; the argmax for a greedy row. On the native sampler where
    it runs (two passes over a row and a sort of its likeliest tokens, where PyTorch makes ~10 operations
    over the vocabulary), else by `sampling.inverse_cdf` over `probabilities`; plain decoding takes the
    same path."""

    def __init__(self, logits: torch.Tensor, sb: SamplingBatch):
        self.logits, self.sb = logits, sb
        self._argmax: list[list[int]] | None = None
        self._native: bool | None = None  # asked at a sampled row's first draw: greedy rows need only the argmax
        self._cdf: torch.Tensor | None = None

    def at(self, b: int, column: int, offset: int) -> int:
        key = self.sb.keys[b]
        if key is None:
            if self._argmax is None:
                self._argmax = argmax(self.logits).tolist()  # [B][k+1]: one call for the batch
            return self._argmax[b][column]
        u = uniform(key, self.sb.positions[b] + offset, TOKEN)
        if self._native is None:
            self._native = native.sampling_usable(self.logits)
            if self._native:
                self.logits = self.logits.contiguous()
        if self._native:
            return native.sample_row(self.logits[b, column], self.sb.transforms[b], u)
        if self._cdf is None:
            # [B, k+1, V]: one running sum for the step, where a sum per drawn position cost k + 1 times more.
            self._cdf = probabilities(self.logits, self.sb).double().cumsum(-1)
        return inverse_cdf(self._cdf[b, column], u)


# target(column, offset): the target's token from its logits at `column` for the position `offset` past the
# row's next token (TargetTokens.at for one row).
Target = Callable[[int, int], int]


def follow_chain(drafts: list[int], target: Target) -> tuple[int, int]:
    """A row's drafts, kept while each is the target's token there → (drafts kept, the target's token
    after them)."""
    for j, d in enumerate(drafts):
        token = target(j, j)
        if token != d:
            return j, token
    return len(drafts), target(len(drafts), len(drafts))


def follow_tree(tokens: list[int], parents: list[int], n: int, target: Target) -> tuple[list[int], int]:
    """A row's draft tree (its first n nodes real): from the sequence's last token, follow the child whose
    token is the target's there, while one is → (the kept nodes, root to leaf; the target's token after
    them)."""
    path, node = [], -1
    while True:
        token = target(node + 1, len(path))
        child = next((j for j in range(n) if parents[j] == node and tokens[j] == token), None)
        if child is None:
            return path, token
        path.append(child)
        node = child


def verify(draft: torch.Tensor, n_draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
           sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for drafts drawn from q → (n_accepted [B], next_token [B]).

    draft [B, k] tokens, of which the first n_draft[b] are real in row b;
    p [B, k+1, V] target probabilities at each draft position and after the last;
    q [B, k, V] the distributions the drafts were drawn from (one-hot for a row of lookup drafts).
    Row b's draft j is tested with its uniform (ACCEPT) at that position, the next token drawn with the
    uniform (TOKEN) of its own: greedy rows (no key) test with 0 and take the argmax.
    """
    B, k = draft.shape
    rows = torch.arange(B, device=draft.device)
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    q_d = q.gather(-1, draft[..., None]).squeeze(-1)
    u = torch.tensor([[0.0 if d is None else d for d in sb.draws(ACCEPT, j)] for j in range(k)],
                     device=draft.device).reshape(k, B).T  # [B, k]
    n_accepted = accepted_run(u < acceptance_probability(p_d, q_d), n_draft)

    p_next = p[rows, n_accepted]  # [B, V]
    rejected = n_accepted < n_draft
    if k and bool(rejected.any()):
        at = n_accepted.clamp(max=k - 1)
        fix = residual(p_next, q[rows, at])
        p_next = torch.where(rejected[:, None], fix, p_next)
    return n_accepted, sample(p_next, sb.draws(TOKEN, n_accepted.tolist()))


def accepted_run(accepted: torch.Tensor, n_draft: torch.Tensor) -> torch.Tensor:
    """accepted [B, k] per draft → [B] how many drafts in a row were accepted, counting only each
    row's first n_draft[b] (the rest is padding)."""
    real = torch.arange(accepted.shape[1], device=accepted.device)[None, :] < n_draft[:, None]  # [B, k]
    return (accepted & real).int().cumprod(dim=1).sum(dim=1)


def acceptance_probability(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """p(d) / q(d), compared with a uniform draw (so capped at 1 in effect)."""
    return torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), 0.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) [B, V]: what to draw from after rejecting a draft drawn from q."""
    out = (p - q).clamp_min(0.0)
    mass = out.sum(dim=-1, keepdim=True)
    # A zero residual only happens when p == q (up to rounding): then p itself is the answer.
    return torch.where(mass > 0, out / mass.clamp_min(1e-30), p)
