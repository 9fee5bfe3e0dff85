"""Where an engine's time goes: drafting, the target's passes (by width: what a pass of k + 1 tokens costs
against one of a single token, as run), and the rest."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from speculant.sequence import SpecStats

log = logging.getLogger("speculant")


@dataclass
class EngineTiming:
    draft_s: float = 0.0
    target_s: float = 0.0
    other_s: float = 0.0
    grammar_s: float = 0.0  # the grammar masks on the target's logits (part of other_s)
    steps: int = 0
    tokens: int = 0
    # Target passes by width (tokens a row verifies: its drafts + 1) → [passes, seconds]: C(k+1)/C(1) as run.
    passes: dict[int, list[float]] = field(default_factory=dict)

    def record(self, draft_s: float, target_s: float, other_s: float, width: int, tokens: int) -> None:
        """A decode step: its drafting, its target pass of `width` tokens a row, the rest; tokens it gave."""
        self.draft_s += draft_s
        self.target_s += target_s
        self.other_s += other_s
        self.steps += 1
        self.tokens += tokens
        at = self.passes.setdefault(width, [0, 0.0])
        at[0] += 1
        at[1] += target_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "passes": {w: list(v) for w, v in self.passes.items()}}

    def pass_ms(self, width: int) -> float | None:
        n, s = self.passes.get(width, (0, 0.0))
        return 1e3 * s / n if n else None


class SpecMetricsLog:
    """vLLM's periodic `SpecDecoding metrics:` line, over the drafts since the last one."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last = time.perf_counter()
        self.logged = SpecStats()

    def maybe_log(self, stats: SpecStats) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval_s:
            return
        interval = stats - self.logged
        if interval.num_drafts:
            log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
                     "tokens, Avg Draft acceptance rate: %.1f%%, Per-position acceptance rate: %s",
                     interval.mean_acceptance_length, interval.num_accepted_tokens, interval.num_draft_tokens,
                     100 * interval.acceptance_rate,
                     ", ".join(f"{a:.3f}" for a in interval.per_position_acceptance))
        self.logged = stats + SpecStats()  # a snapshot
        self.last = now
