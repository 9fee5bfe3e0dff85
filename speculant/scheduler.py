"""Prompt chunks: how much of the new sequences' prompts each engine step feeds.

A prompt is fed in chunks, one chunk's worth a step while other sequences decode, so a long prompt
arriving holds every running stream back by one chunk's pass, never by its whole prefill; with nothing
decoding, every chunk goes in the same step. A prompt's tokens cost compute (on a CPU, tens of
milliseconds each for a 1.5B model), so the chunk that runs beside decoding is sized to cost about one
decode step (`ChunkSizer`): a stream's gap between tokens stays within about twice its usual. Sequences
with the same prompt (the API's n) are fed once: the first one's row takes the chunks and the others copy
it when it is done.

Chunks change no bits: every pass computes a position's keys the same way (models/llama.py, prepare_pass).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from speculant.sequence import Sequence

DEFAULT_PREFILL_CHUNK = 512
MIN_CHUNK = 4  # tokens: below this a chunk's pass is all fixed cost, and a long prompt would never finish
FIRST_CHUNK = 16  # beside decoding, before any chunk has been timed


@dataclass
class ChunkSizer:
    """The prompt tokens a step feeds beside decoding: as many as cost about one decode step, from a
    chunk's measured cost, time = fixed + per_token × tokens, fitted on the recent chunks."""

    chunks: deque = field(default_factory=lambda: deque(maxlen=32))  # (tokens, seconds)
    step_s: float | None = None  # the running batch's recent step time

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.chunks.append((tokens, seconds))

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def size(self, decoding: bool, max_chunk: int) -> int:
        if not decoding:
            return max_chunk
        fit = self.fit()
        if fit is None or self.step_s is None:
            return min(max_chunk, FIRST_CHUNK)
        fixed, per_token = fit
        return max(min(MIN_CHUNK, max_chunk), min(max_chunk, int((self.step_s - fixed) / per_token)))

    def fit(self) -> tuple[float, float] | None:
        """Least squares (fixed, per_token) over the recent chunks; None until a chunk was timed. Chunks of one
        size (the smallest, once the prompt's keys make every token dear) give no slope: their whole cost is
        taken as per token, which only errs towards smaller chunks."""
        n = len(self.chunks)
        if n == 0:
            return None
        xs, ys = [c[0] for c in self.chunks], [c[1] for c in self.chunks]
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        per_token = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        if per_token <= 0:
            return 0.0, my / mx
        return max(0.0, my - per_token * mx), per_token


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
    decode (ChunkSizer.size), every prompt's whole rest otherwise (in passes of at most `chunk`). A group
    whose whole prompt came from the prefix cache gets one empty chunk, which shows the proposer its prompt."""
    budget: int | None = chunk if decoding else None
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
