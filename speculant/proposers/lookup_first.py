"""Prompt lookup first, a model's drafts elsewhere.

Lookup drafts cost nothing and, after a long suffix match, are nearly all accepted; a learned drafter
pays a pass per draft and is right less often, but it drafts where nothing repeats. So a row whose
lookup finds a match verifies those drafts, the others get the model's (with adaptive k: the drafter
whose acceptance promises more, per row).

The model proposer keeps its state in step either way: its `commit` reads the verified tokens (and,
for EAGLE, the target's features), whoever drafted them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculant.proposers.base import Proposal, Proposer, TargetHidden, merged
from speculant.proposers.ngram import NgramProposer, planned_lookup
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence

if TYPE_CHECKING:
    from speculant.adaptive import AdaptiveK


class LookupFirstProposer(Proposer):
    def __init__(self, lookup: NgramProposer, model: Proposer):
        self.lookup, self.model = lookup, model
        method, *options = model.name.split("+")
        behind = lookup.name.split("+")[1:]  # corpus, history
        self.name = "+".join((method, "lookup", *behind, *options))  # as SpeculativeConfig.proposer names it
        self.extra_nodes = model.extra_nodes
        self.capture = model.capture
        self.vocab_mapping = model.vocab_mapping

    def extra_nodes_at(self, batch_size: int) -> int:
        return self.model.extra_nodes_at(batch_size)

    def add(self, seq: Sequence) -> None:
        self.model.add(seq)

    def remove(self, seq: Sequence) -> None:
        self.lookup.remove(seq)
        self.model.remove(seq)

    def forget(self) -> None:
        self.lookup.forget()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def use_prefix_cache(self, capacity_bytes: int) -> bool:
        return self.model.use_prefix_cache(capacity_bytes)

    def prefill(self, seqs: list[Sequence], target: TargetHidden) -> None:
        self.model.prefill(seqs, target)

    def commit(self, seqs: list[Sequence], target: TargetHidden) -> None:
        self.model.commit(seqs, target)

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        found = self.lookup.propose(seqs, ks, sb)
        return self.complete(seqs, found, [0 if n else k for n, k in zip(found.n_draft.tolist(), ks)], sb)

    def propose_adaptive(self, seqs: list[Sequence], limits: list[int], sb: SamplingBatch, policy: AdaptiveK,
                         remaining: list[int] | None) -> Proposal:
        """Lookup's drafts where the policy trusts them more than the model's, the model's in the rows left empty."""
        found = planned_lookup(self.lookup, seqs, limits, sb, policy, remaining, policy.keep_lookup)
        empty = [n == 0 for n in found.n_draft.tolist()]
        k = policy.choose(len(seqs), remaining) if any(empty) else 0
        return self.complete(seqs, found, [min(k, n) if e else 0 for n, e in zip(limits, empty)], sb)

    def complete(self, seqs: list[Sequence], found: Proposal, ks: list[int], sb: SamplingBatch) -> Proposal:
        """The lookup's drafts `found`, with the model's ks[b] drafts in the rows where ks[b] > 0 (rows
        the lookup left empty)."""
        if not any(ks):
            return found
        return merged(found, self.model.propose(seqs, ks, sb))
