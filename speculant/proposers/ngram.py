"""Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens and propose
what followed it. No model, deterministic (q is one-hot)."""

from __future__ import annotations

import numpy as np

from speculant.proposers.base import Proposal, Proposer
from speculant.proposers.corpus import CORPUS_BUCKET, CorpusTable
from speculant.proposers.history import HISTORY_BUCKET, AnswerHistory
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence

CORPUS_UNDER = 2


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """The k tokens that followed the latest earlier match of the longest suffix of length
    n_max down to n_min, and that length; ([], 0) when none matches. Where what followed runs into
    the sequence's end, the drafts repeat it: the match lies one period back in a loop, which goes on.

    Every earlier occurrence of the last token is a candidate match end; each longer suffix keeps
    the candidates whose preceding token matches too. One pass over the sequence, then work on the
    few candidates only (comparing every window for every n cost ~240 µs a row at 250 tokens: 5% of
    a batch-8 step)."""
    L = len(tokens)
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # candidate match ends e: tokens[e] = last
    found, n = -1, 0
    for m in range(1, min(n_max, L - 1) + 1):
        if m > 1:
            ends = ends[ends >= m - 1]
            ends = ends[tokens[ends - (m - 1)] == tokens[L - m]]
        if not len(ends):
            break
        if m >= n_min:
            found, n = int(ends[-1]), m
    if n == 0:
        return [], 0
    drafts = tokens[found + 1:found + 1 + k].tolist()
    # A model caught in a loop (a run of one token, a repeated line) drafted only up to the sequence's end:
    # one token a step through a run of "1"s (bench prompt code-3: 1.89 → 2.01 tokens a step on code, k = 4).
    period = L - 1 - found
    while len(drafts) < k:
        drafts.append(drafts[-period])
    return drafts, n


class NgramProposer(Proposer):
    """Prompt lookup, and where it matches fewer than CORPUS_UNDER tokens, a corpus table's drafts when
    one is given (proposers/corpus.py): simulated, a 2-token match of the prompt's continued right
    more often than the table, a 1-token match less often. With an answer history (proposers/history.py,
    opt-in), an earlier answer that agrees with the sequence's last 8 tokens drafts first (greedy rows)."""

    free_drafts = True

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, corpus: CorpusTable | None = None,
                 history: AnswerHistory | None = None):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.corpus, self.history = corpus, history
        self.name = "ngram" + "+corpus" * (corpus is not None) + "+history" * (history is not None)

    def remove(self, seq: Sequence) -> None:
        if self.history is not None:
            self.history.learn(seq.prompt_ids, seq.output_ids)

    def forget(self) -> None:
        if self.history is not None:
            self.history = AnswerHistory(self.history.max_tokens)

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        found = [self._draft(s.tokens, k, s.params.greedy) if k else ([], 0) for s, k in zip(seqs, ks)]
        return Proposal.from_lists([d for d, _ in found], sb.temperature.device, [n for _, n in found])

    def _draft(self, tokens: list[int], k: int, greedy: bool = True) -> tuple[list[int], int]:
        """A row's drafts and their bucket (adaptive k's acceptance is kept per bucket)."""
        drafts, n = lookup(np.asarray(tokens), k, self.n_min, self.n_max)
        # History drafts for greedy rows only: a sampled answer's token was drawn with probability p(d), and
        # as a draft it is accepted with probability p(d) again, less often than the corpus's likeliest
        # tokens (bench, the same sampled requests again at T = 0.7: 1.14x with the history, 1.23x without).
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
