"""Prompt lookup finds what a brute-force scan finds: the latest match of the longest suffix, and what
followed it, repeated where it runs into the sequence's end."""

from __future__ import annotations

import numpy as np

from speculant.proposers.ngram import lookup


def scan(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for end in range(L - 2, n - 2, -1):
            if all(tokens[end - i] == tokens[L - 1 - i] for i in range(n)):
                loop = list(tokens[end + 1:])  # one period of the loop the match implies
                return [int(loop[j % len(loop)]) for j in range(k)], n
    return [], 0


def test_lookup_matches_a_brute_force_scan():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 60)))
        k, n_min = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        n_max = int(rng.integers(n_min, 6))
        expected = scan(tokens, k, n_min, n_max)
        assert lookup(tokens, k, n_min, n_max) == expected
        hits += expected[1] > 0
    assert 500 < hits < 2000  # both outcomes were exercised


def test_lookup_prefers_the_longest_then_the_latest_match():
    tokens = np.array([7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3])
    assert lookup(tokens, 2, 1, 4) == ([9, 5], 3)  # "1 2 3" at 1..3 beats the later "2 3" at 6..7
    assert lookup(tokens, 2, 1, 2) == ([8, 1], 2)  # capped at 2: the latest "2 3"
    assert lookup(tokens, 2, 4, 4) == ([], 0)


def test_lookup_drafts_k_tokens_through_a_loop():
    run = np.array([4, 1, 1, 1, 1])
    assert lookup(run, 5, 2, 4) == ([1, 1, 1, 1, 1], 3)  # the latest "1 1 1" ends one token back
    line = np.array([5, 7, 8, 9, 7, 8, 9, 7, 8])
    assert lookup(line, 7, 2, 3) == ([9, 7, 8, 9, 7, 8, 9], 3)
