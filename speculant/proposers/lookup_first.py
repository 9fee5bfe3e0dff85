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

import torch
from torch.nn.functional import one_hot, pad

from speculant.proposers.base import MODEL_BUCKET, Proposal, Proposer, TargetHidden, chain_padded
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

    def add(self, seq: Sequence) -> None:
        self.model.add(seq)

    def remove(self, seq: Sequence) -> None:
        self.lookup.remove(seq)
        self.model.remove(seq)

    def forget(self) -> None:
        self.lookup.forget()

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
        drafted = self.model.propose(seqs, ks, sb)
        width = max(found.tokens.shape[1], drafted.tokens.shape[1])
        by_model = drafted.n_draft > 0  # [B]
        found_tokens = pad(found.tokens, (0, width - found.tokens.shape[1]))  # [B, width]
        tokens = torch.where(by_model[:, None], pad(drafted.tokens, (0, width - drafted.tokens.shape[1])),
                             found_tokens)
        n_draft = torch.where(by_model, drafted.n_draft, found.n_draft)
        q = None
        if drafted.q is not None:
            # A lookup draft is deterministic: its q is one-hot, which the acceptance rule reads as
            # "accept with probability p(token)".
            lookup_q = one_hot(found_tokens, drafted.q.shape[-1]).to(drafted.q.dtype)  # [B, width, V]
            model_q = pad(drafted.q, (0, 0, 0, width - drafted.q.shape[1]))
            q = torch.where(by_model[:, None, None], model_q, lookup_q)
        model_rows = by_model.tolist()
        buckets = [MODEL_BUCKET if m else key for m, key in zip(model_rows, found.bucket_list())]
        parents = None
        if drafted.parents is not None:
            # A lookup row is a chain.
            parents = [chain_padded(tree if m else [], width) for m, tree in zip(model_rows, drafted.parents)]
        return Proposal(tokens, n_draft, q, buckets, parents)
