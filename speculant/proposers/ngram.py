"""Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens and propose
what followed it. No model, deterministic (q is one-hot)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from speculant.proposers.base import Proposal, Proposer
from speculant.proposers.corpus import CORPUS_BUCKET, CorpusTable
from speculant.proposers.history import HISTORY_BUCKET, AnswerHistory
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence

if TYPE_CHECKING:
    from speculant.adaptive import AdaptiveK

CORPUS_UNDER = 2


class SuffixIndex:
    """The latest end of every n-gram (n ≤ n_max) of a growing token list, its last token left out: prompt
    lookup's matches in O(n_max) dictionary reads a step, where a pass over the whole sequence grows with
    the context, per step and per row. Tokens are only ever appended to a sequence, so the index only
    grows."""

    def __init__(self, tokens: list[int], n_max: int):
        self.tokens, self.n_max = tokens, n_max
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram → the position of its last token
        self.indexed = 0  # ends 0 .. indexed - 1 are in

    def match(self, n_min: int) -> tuple[int, int]:
        """(The end e < len - 1 of the latest earlier occurrence of the longest suffix of n_max down to n_min
        tokens, its length n); (-1, 0) when none occurs."""
        tokens = self.tokens
        L = len(tokens)
        for e in range(self.indexed, L - 1):
            for n in range(1, min(self.n_max, e + 1) + 1):
                self.latest[tuple(tokens[e - n + 1:e + 1])] = e
        self.indexed = max(self.indexed, L - 1)
        for n in range(min(self.n_max, L - 1), n_min - 1, -1):
            end = self.latest.get(tuple(tokens[L - n:]))
            if end is not None:
                return end, n
        return -1, 0


def continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """The k tokens that followed a match ending at `end`. Where they run into the sequence's end, they
    repeat: the match lies one period back in a loop, which goes on (drafting only up to the end, a run
    of one token would go one token a step)."""
    period = len(tokens) - 1 - end
    return [tokens[end + 1 + j % period] for j in range(k)]


class NgramProposer(Proposer):
    """Prompt lookup, and where it matches fewer than CORPUS_UNDER tokens, a corpus table's drafts when
    one is given (proposers/corpus.py): simulated, a 2-token match of the prompt's continued right
    more often than the table, a 1-token match less often. With an answer history (proposers/history.py,
    opt-in), an earlier answer that agrees with the sequence's last 8 tokens drafts first (greedy rows)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, corpus: CorpusTable | None = None,
                 history: AnswerHistory | None = None):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.corpus, self.history = corpus, history
        self.name = "ngram" + "+corpus" * (corpus is not None) + "+history" * (history is not None)
        self.indexes: dict[str, SuffixIndex] = {}  # by request id

    def remove(self, seq: Sequence) -> None:
        self.indexes.pop(seq.request_id, None)
        if self.history is not None:
            self.history.learn(seq.prompt_ids, seq.output_ids)

    def forget(self) -> None:
        if self.history is not None:
            self.history = AnswerHistory(self.history.max_tokens)

    def find(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[int]]:
        found = [self._draft(self._index(s), k, s.params.greedy) if k else ([], 0) for s, k in zip(seqs, ks)]
        return [d for d, _ in found], [n for _, n in found]

    def propose_adaptive(self, seqs: list[Sequence], limits: list[int], sb: SamplingBatch, policy: AdaptiveK,
                         remaining: list[int] | None) -> Proposal:
        return planned_lookup(self, seqs, limits, sb, policy, remaining)

    def _index(self, seq: Sequence) -> SuffixIndex:
        index = self.indexes.get(seq.request_id)
        if index is None or index.tokens is not seq.tokens:
            index = self.indexes[seq.request_id] = SuffixIndex(seq.tokens, self.n_max)
        return index

    def _draft(self, index: SuffixIndex, k: int, greedy: bool = True) -> tuple[list[int], int]:
        """A row's drafts and their bucket (adaptive k's acceptance is kept per bucket)."""
        tokens = index.tokens
        end, n = index.match(self.n_min)
        drafts = continuation(tokens, end, k) if n else []
        # History drafts for greedy rows only: a sampled answer's token was drawn with probability p(d), and
        # as a draft it is accepted with probability p(d) again, less often than the corpus's likeliest tokens.
        if self.history is not None and greedy:
            past = self.history.draft(tokens, k)
            # 8 agreeing tokens, more than lookup matches (6 at most by default); but an answer that ends
            # soon after (a loop's latest turn) loses to a longer lookup draft.
            if past and len(past) >= len(drafts):
                return past, HISTORY_BUCKET
        if self.corpus is not None and n < CORPUS_UNDER:
            from_corpus, context = self.corpus.draft(tokens, k)
            if from_corpus:
                return from_corpus, CORPUS_BUCKET + context
        return drafts, n


def planned_lookup(lookup: NgramProposer, seqs: list[Sequence], limits: list[int], sb: SamplingBatch,
                   policy: AdaptiveK, remaining: list[int] | None,
                   keep: Callable[[list[int], list[int]], list[int]] | None = None) -> Proposal:
    """Lookup's drafts cost no model pass: find all of them, then keep as many as the policy plans to verify.
    `keep` (buckets, available) → available first leaves out the rows a model drafts better."""
    if not policy.worth_proposing(len(seqs)):
        return Proposal.empty(len(seqs), sb.temperature.device)
    drafts, buckets = lookup.find(seqs, limits)
    available = [len(d) for d in drafts]
    if keep is not None:
        available = keep(buckets, available)
    plan = policy.plan(buckets, available, remaining=remaining)
    return Proposal.from_lists([d[:n] for d, n in zip(drafts, plan)], sb.temperature.device, buckets)
