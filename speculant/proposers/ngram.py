"""Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens and propose
what followed it. No model, deterministic (q is one-hot)."""

from __future__ import annotations

import numpy as np

from speculant.proposers.base import Proposal, Proposer
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """The k tokens that followed the latest earlier match of the longest suffix of length
    n_max down to n_min, and that length; ([], 0) when none matches."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start:start + k].tolist(), n
    return [], 0


class NgramProposer(Proposer):
    name = "ngram"
    free_drafts = True

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        found = [lookup(np.asarray(s.tokens), k, self.n_min, self.n_max) if k else ([], 0)
                 for s, k in zip(seqs, ks)]
        return Proposal.from_lists([d for d, _ in found], sb.temperature.device, [n for _, n in found])
