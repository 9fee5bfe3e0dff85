"""Prompt lookup finds what a brute-force scan finds: the latest match of the longest suffix, and what
followed it, repeated where it runs into the sequence's end, also as the sequence grows."""

from __future__ import annotations

import numpy as np

from speculant.proposers.ngram import SuffixIndex, continuation


def scan(tokens: list[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for end in range(L - 2, n - 2, -1):
            if all(tokens[end - i] == tokens[L - 1 - i] for i in range(n)):
                loop = list(tokens[end + 1:])  # one period of the loop the match implies
                return [int(loop[j % len(loop)]) for j in range(k)], n
    return [], 0


def lookup(index: SuffixIndex, k: int, n_min: int) -> tuple[list[int], int]:
    end, n = index.match(n_min)
    return (continuation(index.tokens, end, k), n) if n else ([], 0)


def test_lookup_matches_a_brute_force_scan_as_the_sequence_grows():
    rng = np.random.default_rng(0)
    hits = checked = 0
    for _ in range(300):
        full = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(2, 60))).tolist()
        k, n_min = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        n_max = int(rng.integers(n_min, 6))
        # Grown as decoding grows it: a few tokens a step, the index asked after each.
        tokens = full[:int(rng.integers(1, len(full)))]
        index = SuffixIndex(tokens, n_max)
        while True:
            expected = scan(tokens, k, n_min, n_max)
            assert lookup(index, k, n_min) == expected
            hits, checked = hits + (expected[1] > 0), checked + 1
            if len(tokens) == len(full):
                break
            tokens.extend(full[len(tokens):len(tokens) + int(rng.integers(1, 5))])
    assert 0.25 * checked < hits < checked  # both outcomes were exercised


def test_lookup_prefers_the_longest_then_the_latest_match():
    tokens = [7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    assert lookup(SuffixIndex(tokens, 4), 2, 1) == ([9, 5], 3)  # "1 2 3" at 1..3 beats the later "2 3" at 6..7
    assert lookup(SuffixIndex(tokens, 2), 2, 1) == ([8, 1], 2)  # capped at 2: the latest "2 3"
    assert lookup(SuffixIndex(tokens, 4), 2, 4) == ([], 0)


def test_lookup_drafts_k_tokens_through_a_loop():
    run = [4, 1, 1, 1, 1]
    assert lookup(SuffixIndex(run, 4), 5, 2) == ([1, 1, 1, 1, 1], 3)  # the latest "1 1 1" ends one token back
    line = [5, 7, 8, 9, 7, 8, 9, 7, 8]
    assert lookup(SuffixIndex(line, 3), 7, 2) == ([9, 7, 8, 9, 7, 8, 9], 3)
