"""Prompt chunks: how much of the new sequences' prompts each engine step feeds.

While other sequences decode, a prompt rides in their step: its next chunk is one more row of the running
batch's verify pass (an engine step's `riders`), so a long prompt arriving holds every running stream back by
that row's compute, never by its whole prefill, and costs no read of the weights of its own. The chunk is
sized to cost at most about 1.5 decode steps more (`ChunkSizer`): a stream's gap between tokens stays within
about 2.5 times its usual. With nothing decoding, every prompt goes in passes of its own, `max_chunk` tokens
each, but its last chunk, which the pass of its first token feeds (`Prefill.tail`). Sequences with the same
prompt (the API's n) are fed once: the first one's row takes the chunks and the others copy it when it is done.

Chunks change no bits: every pass computes a position's keys the same way (models/llama.py, prepare_pass),
and a row's bits do not depend on the other rows of its pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from speculant.config import DEFAULT_PREFILL_CHUNK  # noqa: F401 (the scheduler's default, kept in config.py)
from speculant.sequence import Sequence

MIN_CHUNK = 4  # tokens, where passes pad their rows: a long prompt must move on even where every step is dear
BUDGET_STEPS = 1.5  # what a chunk may add to a step, in steps: a stream's wait stays within 2.5 of its steps


def rider_positions(tokens: int, rows: int, width: int) -> int:
    """Positions a chunk of `tokens` adds to a padded pass of `rows` rows `width` wide: its own row, padded
    to the pass's width, and the running rows' padding where the chunk is wider than they are."""
    return max(tokens, width) + rows * max(0, tokens - width)


def tiles(rows: int, tile: int) -> int:
    """Tiles of `tile` rows that `rows` rows take."""
    return -(-rows // tile)


def added_tiles(tokens: int, positions: int, tile: int) -> int:
    """Tiles of `tile` rows a chunk of `tokens` adds to a packed pass of `positions` rows: the native matmuls
    unpack a block of weights once per tile, so a pass costs by the tile, and a chunk that fills the last
    one is nearly free."""
    return tiles(positions + tokens, tile) - tiles(positions, tile)


@dataclass
class ChunkSizer:
    """The prompt tokens a decode step carries: as many as cost at most BUDGET_STEPS steps more. A step's extra
    cost is fitted as fixed + per_unit × the units its chunk adds (tiles of a packed pass, added_tiles; else
    the positions of a padded one, rider_positions), on the recent steps that carried chunks, against the
    recent steps that did not."""

    tile: int = 0  # rows a native matmul takes at once, where passes are packed; 0: passes are padded
    extra: deque = field(default_factory=lambda: deque(maxlen=32))  # (units added, seconds added)
    step_s: float | None = None  # the running batch's recent step time, without chunks
    width: int = 1  # the running batch's last pass: its widest row
    positions: int = 1  # and its real tokens
    learned: float = 0.0  # the last fitted per_unit: chunks of one size later do not forget it

    def units(self, tokens: int, rows: int) -> int:
        if self.tile:
            return added_tiles(tokens, self.positions, self.tile)
        return rider_positions(tokens, rows, self.width)

    def observe_step(self, seconds: float, chunk: int = 0, rows: int = 1, width: int = 1,
                     positions: int = 1) -> None:
        """A step's time, the prompt tokens it carried, and its decoding rows: their count, the widest, their
        real tokens."""
        if chunk and self.step_s is not None:
            self.extra.append((self.units(chunk, rows), max(0.0, seconds - self.step_s)))
        elif not chunk:
            self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        self.width, self.positions = width, positions

    def size(self, rows: int, max_chunk: int) -> int:
        """A chunk's tokens beside `rows` decoding rows, at most max_chunk. Before any step carried one, as
        many as add no padding (a packed pass: its last tile's free rows, or one more tile)."""
        low = MIN_CHUNK if not self.tile else self.tile - self.positions % self.tile
        fit = self.fit()
        if fit is None or self.step_s is None:
            return min(max_chunk, low if self.tile else max(low, self.width))
        fixed, per_unit = fit
        afford = (BUDGET_STEPS * self.step_s - fixed) / per_unit
        n = low
        while n < max_chunk and self.units(n + 1, rows) <= afford:
            n += 1
        return min(n, max_chunk)

    def fit(self) -> tuple[float, float] | None:
        """Least squares (fixed, per_unit) over the recent steps with chunks; None until one was timed. Steps
        that added one size give no slope: their whole cost is taken per unit, which only errs towards
        smaller chunks."""
        n = len(self.extra)
        xs, ys = [c[0] for c in self.extra], [c[1] for c in self.extra]
        if n == 0 or not any(ys):  # nothing timed, or chunks that cost no measurable time: no cost to go by
            return None
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        per_unit = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        if per_unit > 0:
            self.learned = per_unit
            return max(0.0, my - per_unit * mx), per_unit
        if mx and not self.tile:
            return 0.0, max(my / mx, self.learned)
        # Chunks that added no tile, or one size of them: a tile costs what was learned, else what the step's
        # own tiles cost (a guess, soon corrected: the chunk that takes a tile times one).
        own = tiles(self.positions, self.tile) if self.tile else 1
        per_tile = max(self.learned or (self.step_s or my) / max(own, 1), my / mx if mx else 0.0)
        return max(0.0, my - per_tile * mx), per_tile


@dataclass
class Prefill:
    """New sequences sharing one prompt; the first one's cache row is fed."""

    seqs: list[Sequence]
    started: bool = False  # the proposer has been shown the prompt's first chunk (or its cached prefix)
    tail: int = 0  # prompt tokens left to the first decode step, before the last one (Scheduler.plan)

    @property
    def lead(self) -> Sequence:
        return self.seqs[0]

    @property
    def remaining(self) -> int:
        """Prompt tokens still to feed: all but the last one and the tail, which the first decode step feeds."""
        return len(self.lead.tokens) - 1 - self.lead.num_cached - self.tail

    @property
    def done(self) -> bool:
        return self.started and self.remaining == 0

    def next_chunk(self, n: int) -> list[int]:
        """The next n prompt tokens to feed."""
        return self.lead.tokens[self.lead.num_cached:self.lead.num_cached + n]


def group_by_prompt(seqs: list[Sequence]) -> list[Prefill]:
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(tuple(seq.tokens[:-1]), []).append(seq)
    return [Prefill(g) for g in groups.values()]


def plan_chunks(prefills: list[Prefill], chunk: int, decoding: bool) -> list[tuple[Prefill, int]]:
    """This step's chunks, (group, tokens) in arrival order: `chunk` tokens in all while other sequences
    decode (ChunkSizer.size: they ride in the decode pass), every prompt's whole rest otherwise (in passes of
    at most `chunk`). A group whose whole prompt came from the prefix cache gets one empty chunk, which shows
    the proposer its prompt."""
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
