"""A step's drafts: how many each row may have (k, or the adaptive policy's plan; none for a request's first
token; never past max_tokens), a grammar's forced tokens first, the proposer's for the rest."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from speculant.adaptive import AdaptiveK
from speculant.grammar_steps import forced_drafts
from speculant.proposers import Proposal, Proposer, TargetHidden
from speculant.proposers.base import merged
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence

log = logging.getLogger("speculant")


@dataclass
class Drafter:
    proposer: Proposer | None
    k: int
    adaptive: AdaptiveK | None
    first_token_alone: bool
    device: torch.device

    def adapts(self, batch: list[Sequence]) -> bool:
        """Whether the adaptive policy chooses this step's drafts (and learns from the step)."""
        return self.adaptive is not None and len(batch) >= self.adaptive.from_batch

    def limit(self, seq: Sequence) -> int:
        # The first token is what a caller waits on: it comes from a pass over the prompt's last token alone,
        # before the proposer has caught up on the prompt. A step yields accepted + 1 tokens: never draft past
        # max_tokens.
        if not seq.speculate or (self.first_token_alone and seq.num_generated == 0):
            return 0
        return max(0, min(self.k, seq.max_tokens - seq.num_generated - 1))

    def propose(self, batch: list[Sequence], sb: SamplingBatch, queue_waiting: bool) -> Proposal:
        """Each row's drafts for this step; `queue_waiting`: a request waits for a row."""
        if self.proposer is None:
            return Proposal.empty(len(batch), self.device)
        limits = [self.limit(s) for s in batch]
        forced = forced_drafts(batch, limits) if sb.grammars is not None else None
        if forced is not None:
            limits = [0 if f else n for f, n in zip(forced, limits)]
        proposal = self._proposer_drafts(batch, limits, sb, queue_waiting)
        return proposal if forced is None else merged(proposal, Proposal.from_lists(forced, self.device))

    def _proposer_drafts(self, batch: list[Sequence], limits: list[int], sb: SamplingBatch,
                         queue_waiting: bool) -> Proposal:
        if self.adapts(batch):
            # With no request waiting for a row the batch is done when its last row is (adaptive.batch_progress).
            remaining = None if queue_waiting else [s.max_tokens - s.num_generated for s in batch]
            return self.proposer.propose_adaptive(batch, limits, sb, self.adaptive, remaining)
        if not any(limits):
            return Proposal.empty(len(batch), self.device)
        return self.proposer.propose(batch, limits, sb)

    def commit(self, batch: list[Sequence], target: TargetHidden) -> None:
        """Show the proposer what the target committed (its features of the fed tokens)."""
        if self.proposer is None:
            return
        try:
            self.proposer.commit(batch, target)
        except Exception:
            # The tokens are committed; only the drafts' state is in doubt: start it afresh.
            log.exception("proposer commit failed; resetting its state for %d sequences", len(batch))
            for seq in batch:
                self.reset(seq)

    def reset(self, seq: Sequence) -> None:
        """Forget a sequence's draft state (it may be half updated): the proposer starts it over, so drafts get
        worse for a while, the output stays the same."""
        if self.proposer is not None and not seq.finished:
            self.proposer.remove(seq)
            self.proposer.add(seq)
