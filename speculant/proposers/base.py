"""The proposer interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.functional import pad

from speculant.adaptive import MODEL_BUCKET
from speculant.models.attention import tree_layout
from speculant.sampling import DRAFT, SamplingBatch, argmax, constrain, probabilities, sample
from speculant.verify import TargetTokens

if TYPE_CHECKING:
    from speculant.adaptive import AdaptiveK
    from speculant.sequence import Sequence


def pad_rows(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token rows → (tokens [B, T] padded with 0, lengths [B]), T the longest row."""
    lengths = [len(r) for r in rows]
    T = max(lengths, default=0)
    # One tensor from padded lists, not one per row: each tensor made costs a call, and this runs every step.
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), T)
    return tokens.to(device), torch.tensor(lengths, dtype=torch.long, device=device)


def chain_padded(parents: list[int], width: int) -> list[int]:
    """A draft tree's parents list (see Proposal.parents) padded to `width` with a chain: padding drafts
    are never real, but a pass needs a place for each."""
    return parents + list(range(len(parents) - 1, width - 1))


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] draft tokens, padded with 0 past n_draft
    n_draft: torch.Tensor  # [B] how many of row b's tokens are real (0..k)
    q: torch.Tensor | None  # [B, k, V] the distribution each token was drawn from (rows of by_rule); None: none was
    # Row b's drafts are judged by the acceptance seen in its bucket (adaptive.py); n-gram lookup: the
    # length of the suffix that matched. None: one bucket for all.
    buckets: list[int] | None = None
    # A draft tree of deterministic drafts (q None): parents[b][j] is the draft that row b's draft j
    # continues (-1: the sequence's last token), parents before children. None: a chain, each draft
    # continues the one before.
    parents: list[list[int]] | None = None
    # Rows whose drafts were drawn from q (a model's, sampled): the acceptance rule verifies them. The other
    # rows' drafts are deterministic (lookup, a grammar's forced tokens) and are verified by coupling, whatever
    # shares the step. None: every row where q is set.
    by_rule: list[bool] | None = None

    @classmethod
    def from_lists(cls, drafts: list[list[int]], device: torch.device, buckets: list[int] | None = None) -> Proposal:
        return cls(*pad_rows(drafts, device), None, buckets)

    @classmethod
    def empty(cls, batch_size: int, device: torch.device) -> Proposal:
        """No drafts for any of the batch's rows: made once per batch size and device and only read (plain
        decoding asks for one every step)."""
        if (batch_size, device) not in _EMPTY:
            _EMPTY[batch_size, device] = cls.from_lists([[] for _ in range(batch_size)], device)
        return _EMPTY[batch_size, device]

    def bucket_list(self) -> list[int]:
        return self.buckets if self.buckets is not None else [MODEL_BUCKET] * len(self.n_draft)

    def depths(self) -> list[int]:
        """Drafts each row could have accepted: its number of drafts, a tree's deepest branch."""
        n_draft = self.n_draft.tolist()
        if self.parents is None:
            return n_draft
        depths, _ = tree_layout([parents[:n] for parents, n in zip(self.parents, n_draft)])
        return [max(d, default=-1) + 1 for d in depths]  # tree_layout counts a first draft's depth 0

    def placed(self, rows: list[int], batch_size: int) -> Proposal:
        """This proposal for a sub-batch, its row i put at row rows[i] of the whole batch (the other
        rows draft nothing)."""
        if rows == list(range(batch_size)):
            return self
        at = torch.tensor(rows, device=self.tokens.device)
        tokens = self.tokens.new_zeros(batch_size, self.tokens.shape[1]).index_copy_(0, at, self.tokens)
        n_draft = self.n_draft.new_zeros(batch_size).index_copy_(0, at, self.n_draft)
        q = None if self.q is None else self.q.new_zeros(batch_size, *self.q.shape[1:]).index_copy_(0, at, self.q)
        parents = None
        if self.parents is not None:
            parents = [chain_padded([], self.tokens.shape[1]) for _ in range(batch_size)]
            for row, p in zip(rows, self.parents):
                parents[row] = p
        by_rule = None
        if q is not None:
            by_rule = [False] * batch_size
            for row, ruled in zip(rows, self.rule_list()):
                by_rule[row] = ruled
        return Proposal(tokens, n_draft, q, parents=parents, by_rule=by_rule)

    def rule_list(self) -> list[bool]:
        """Per row, whether the acceptance rule verifies its drafts (given q; see by_rule)."""
        if self.q is None:
            return [False] * len(self.n_draft)
        return self.by_rule if self.by_rule is not None else [True] * len(self.n_draft)


_EMPTY: dict[tuple[int, torch.device], Proposal] = {}


def merged(a: Proposal, b: Proposal) -> Proposal:
    """Row by row, b's drafts where b has any, a's elsewhere; q where either carries it, each row keeping
    its own verification (by_rule: deterministic rows are coupled in any batch). Where one side is a tree,
    the other's rows are chains."""
    width = max(a.tokens.shape[1], b.tokens.shape[1])
    take_b = b.n_draft > 0  # [B]
    a_tokens, b_tokens = (pad(p.tokens, (0, width - p.tokens.shape[1])) for p in (a, b))
    tokens = torch.where(take_b[:, None], b_tokens, a_tokens)
    n_draft = torch.where(take_b, b.n_draft, a.n_draft)
    rows = take_b.tolist()
    q, by_rule = None, None
    if a.q is not None or b.q is not None:
        like = a.q if a.q is not None else b.q

        def q_of(p: Proposal) -> torch.Tensor:
            # A deterministic side's rows are never read (by_rule is False there).
            if p.q is None:
                return like.new_zeros(len(rows), width, like.shape[-1])
            return pad(p.q, (0, 0, 0, width - p.q.shape[1]))

        q = torch.where(take_b[:, None, None], q_of(b), q_of(a))
        by_rule = [rb if t else ra for t, ra, rb in zip(rows, a.rule_list(), b.rule_list())]
    buckets = [kb if t else ka for t, ka, kb in zip(rows, a.bucket_list(), b.bucket_list())]
    parents = None
    if a.parents is not None or b.parents is not None:
        def tree(p: Proposal, row: int) -> list[int]:
            return chain_padded(p.parents[row] if p.parents is not None else [], width)

        parents = [tree(b, i) if t else tree(a, i) for i, t in enumerate(rows)]
    return Proposal(tokens, n_draft, q, buckets, parents, by_rule)


@dataclass
class TargetHidden:
    """The target's final hidden states from a verify pass (or the layers the proposer's `capture` names), for
    proposers that draft from them (EAGLE). Row b fed the sequence's unseen tokens, then its drafts, from
    position start[b]."""

    hidden: torch.Tensor  # [B, T, D]
    start: list[int]
    n_valid: list[int]  # fed tokens that are now part of the sequence (unseen + accepted drafts)


class Proposer:
    """Stateless by default; a proposer with a model keeps per-sequence state (a KV cache row).

    The engine calls, per step, `propose` (fixed k) or `propose_adaptive` (k from the adaptive policy), then
    `commit` with what the target verified; `add`, `prefill` and `remove` follow a sequence's life."""

    name = "none"
    # Target layers whose input hidden states the proposer reads (an EAGLE-3 head's, Transformer.forward's
    # `capture`): the runner hands those to prefill and commit instead of the final hidden states. None: those.
    capture: tuple[int, ...] | None = None
    # Drafts a row may get beyond the k asked for: a tree's other candidates (they add width, not depth).
    extra_nodes = 0
    # How a draft of another vocabulary maps to the target's (cross_vocab.py), as reports name it; None: no map.
    vocab_mapping: str | None = None

    def extra_nodes_at(self, batch_size: int) -> int:
        """The drafts beyond k a row brings to a pass of this batch size (a proposer may draft trees for a
        sequence alone, chains in a batch)."""
        return self.extra_nodes

    def add(self, seq: Sequence) -> None:
        """A sequence joins the running batch."""

    def remove(self, seq: Sequence) -> None:
        """A sequence leaves (finished or aborted): free its state."""

    def forget(self) -> None:
        """Drop what was learned from earlier requests (an answer history)."""

    # Bytes a token of a sequence costs the proposer's own KV cache (a draft model's); 0: none.
    kv_bytes_per_token = 0

    def use_prefix_cache(self, capacity_bytes: int) -> bool:
        """The engine keeps past sequences' keys for later requests (prefix_cache.py): keep the proposer's
        own per-sequence state alike, in at most `capacity_bytes`. False where the proposer cannot start
        a sequence from a cached prefix of the target's."""
        return True

    def prefill(self, seqs: list[Sequence], target: TargetHidden) -> None:
        """A chunk of new sequences' prompts went through the target (the prompts but their last token, in
        one or more chunks; an empty one where the prefix cache held the whole prompt)."""
        self.commit(seqs, target)

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        """Up to ks[b] draft tokens continuing seqs[b].tokens."""
        drafts, buckets = self.find(seqs, ks)
        return Proposal.from_lists(drafts, sb.temperature.device, buckets)

    def propose_adaptive(self, seqs: list[Sequence], limits: list[int], sb: SamplingBatch, policy: AdaptiveK,
                         remaining: list[int] | None) -> Proposal:
        """The drafts `policy` judges worth a verify pass, at most limits[b] for row b. `remaining`: each
        row's tokens left to its limit when no request waits for a slot (adaptive.batch_progress), else None.
        Drafts that cost a model pass are made only as many as the policy chooses."""
        k = policy.choose(len(seqs), remaining)
        ks = [min(k, n) for n in limits]
        if not any(ks):
            return Proposal.empty(len(seqs), sb.temperature.device)
        return self.propose(seqs, ks, sb)

    def find(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[int]]:
        """A free proposer's drafts as lists (up to ks[b] continuing seqs[b].tokens) and their buckets: with
        adaptive k they are trimmed to the policy's plan before they become the step's tensors."""
        raise NotImplementedError

    def draw(self, logits: torch.Tensor, sb: SamplingBatch,
             vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For proposers with a model: logits [B, 1, N] → a token per row [B] and q [B, V], the
        distribution it was drawn from: the request's transforms applied exactly as to the target's,
        its grammar first (None for an all-greedy batch: its drafts are deterministic). `vocab`: the
        target ids of the N logits (a draft vocabulary), None when N is the whole vocabulary. Each
        constrained row's draft is pushed onto its grammar state, so its next draft is masked after it."""
        if sb.grammars is not None:
            logits = constrain(logits, self.grammar_masks(sb, vocab, logits.device))
        if sb.all_greedy:
            token, q = argmax(logits[:, 0]), None
        else:
            q = probabilities(logits, sb)[:, 0]
            token = sample(q, sb.draws(DRAFT))
            seeded = [b for b in range(len(sb.keys)) if sb.is_seeded(b)]
            if seeded:
                # A seeded row's draft is drawn from these logits as plain decoding draws the target's token at
                # that position (its sampler, its uniform), and verified by coupling (verify.rule_rows): the
                # row writes plain decoding's tokens at any k and beside any rows, adaptive k or not.
                coupled = TargetTokens(logits, sb)
                token[seeded] = torch.tensor([coupled.at(b, 0, 0) for b in seeded], device=token.device)
        if vocab is not None:
            token = vocab[token]
            if q is not None:
                q = torch.zeros(q.shape[0], self.vocab_size, device=q.device, dtype=q.dtype).index_copy_(1, vocab, q)
        if sb.grammars is not None:
            for grammar, t in zip(sb.grammars, token.tolist()):
                if grammar is not None:
                    grammar.push(t)
        return token, q

    # The target's vocabulary size, for a draw over a draft vocabulary.
    vocab_size = 0

    @staticmethod
    def grammar_masks(sb: SamplingBatch, vocab: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """[B, 1, N]: the tokens each row's grammar allows next (all of them in a free row)."""
        from speculant.structured.grammar import free_bitmask, unpack

        V = next(g for g in sb.grammars if g is not None).vocab_size
        free = free_bitmask(V)
        allowed = unpack([free if g is None else g.bitmask() for g in sb.grammars], V).to(device)
        if vocab is not None:
            allowed = allowed[:, vocab]
            # No allowed token among the draft's: its q stays unmasked, and its draft is cut (drop_forbidden).
            allowed |= ~allowed.any(dim=-1, keepdim=True)
        return allowed[:, None]

    def commit(self, seqs: list[Sequence], target: TargetHidden) -> None:
        """The sequences' tokens were extended by the verifier: drop state past the agreed prefix."""
