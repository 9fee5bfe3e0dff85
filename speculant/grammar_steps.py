"""What a step does for its constrained rows: drafts a grammar forces (free of any model pass), drafts cut at
the first one a grammar forbids, and the target's logits masked at each draft position, by the same masks the
proposer drew under, so p and q see one transform. Rows without a grammar pass through untouched."""

from __future__ import annotations

from dataclasses import replace

import torch

from speculant.proposers import Proposal
from speculant.sampling import constrain
from speculant.sequence import Sequence


def forced_drafts(batch: list[Sequence], limits: list[int]) -> list[list[int]] | None:
    """The tokens each constrained row's grammar forces next (a key, its quotes, a brace), up to its draft
    limit: drafts verified like any other (the proposer drafts the rows that have none). None when no row has
    any."""
    forced = [s.grammar.forced(n) if s.grammar is not None else [] for s, n in zip(batch, limits)]
    return forced if any(forced) else None


def settle_grammars(batch: list[Sequence]) -> None:
    """Take back drafts pushed into the grammars (a proposer's, or a step that raised)."""
    for seq in batch:
        if seq.grammar is not None:
            seq.grammar.settle()


def drop_forbidden(batch: list[Sequence], proposal: Proposal) -> Proposal:
    """A chain's drafts up to the first one its row's grammar forbids: the target's masked p gives it no mass,
    so it could never be accepted, and the masks past it mean nothing. (A tree's forbidden nodes stay:
    `constrain_logits` leaves them unreachable.)"""
    if proposal.parents is not None:
        return proposal
    drafts, n_draft = proposal.tokens.tolist(), proposal.n_draft.tolist()
    kept = [n if s.grammar is None else s.grammar.valid_prefix(d[:n]) for s, d, n in zip(batch, drafts, n_draft)]
    if kept == n_draft:
        return proposal
    return replace(proposal, n_draft=torch.tensor(kept, device=proposal.n_draft.device))


def constrain_logits(batch: list[Sequence], proposal: Proposal, logits: torch.Tensor) -> torch.Tensor:
    """The target's logits [B, k+1, V] under each constrained row's grammar: column 0 masked at the committed
    state, column j + 1 at the state after draft j and its ancestors."""
    from speculant.structured.grammar import free_bitmask, unpack

    B, T, V = logits.shape
    free = free_bitmask(V)
    drafts, n_draft = proposal.tokens.tolist(), proposal.n_draft.tolist()
    masks: list[bytes] = []
    for b, seq in enumerate(batch):
        if seq.grammar is None:
            masks += [free] * T
            continue
        parents = None if proposal.parents is None else proposal.parents[b][:n_draft[b]]
        row = seq.grammar.masks_along(drafts[b][:n_draft[b]], parents)
        masks += row + [free] * (T - len(row))
    allowed = unpack(masks, V).view(B, T, V).to(logits.device)
    return constrain(logits, allowed)
