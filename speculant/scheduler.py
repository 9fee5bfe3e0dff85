"""Prompt chunks: how much of the new sequences' prompts each engine step feeds.

A prompt is fed in chunks of at most `chunk` tokens, one chunk's worth a step while other sequences
decode, so a long prompt arriving holds every running stream back by one chunk's pass, never by its
whole prefill; with nothing decoding, every chunk goes in the same step. Sequences with the same prompt
(the API's n) are fed once: the first one's row takes the chunks and the others copy it when it is done.

Chunks change no bits: every pass computes a position's keys the same way (models/llama.py, prepare_pass).
"""

from __future__ import annotations

from dataclasses import dataclass

from speculant.sequence import Sequence

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class Prefill:
    """New sequences sharing one prompt; the first one's cache row is fed."""

    seqs: list[Sequence]
    started: bool = False  # the proposer has been shown the prompt's first chunk (or its cached prefix)

    @property
    def lead(self) -> Sequence:
        return self.seqs[0]

    @property
    def remaining(self) -> int:
        """Prompt tokens still to feed: all but the last one, which the first decode step feeds."""
        return len(self.lead.tokens) - 1 - self.lead.num_cached

    @property
    def done(self) -> bool:
        return self.started and self.remaining == 0


def group_by_prompt(seqs: list[Sequence]) -> list[Prefill]:
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(tuple(seq.tokens[:-1]), []).append(seq)
    return [Prefill(g) for g in groups.values()]


def plan_chunks(prefills: list[Prefill], chunk: int, decoding: bool) -> list[tuple[Prefill, int]]:
    """This step's chunks, (group, tokens) in arrival order: `chunk` tokens in all while other sequences
    decode, every prompt's whole rest otherwise (in passes of at most `chunk`). A group whose whole
    prompt came from the prefix cache gets one empty chunk, which shows the proposer its prompt."""
    budget = chunk if decoding else None
    plan = []
    for group in prefills:
        left = group.remaining
        if left == 0 and not group.started:
            plan.append((group, 0))
        while left and (budget is None or budget > 0):
            n = min(left, chunk, budget if budget is not None else chunk)
            plan.append((group, n))
            left -= n
            if budget is not None:
                budget -= n
        if budget is not None and budget <= 0:
            break
    return plan
