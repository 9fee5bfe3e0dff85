"""Adaptive speculation: choose k each step from the target's measured cost curve and the
running acceptance, and switch speculation off where it would lose (large batches, proposers
that keep missing).

The choice maximises DESIGN.md §3's predicted speed-up
    S(k) = E(k) / (C_B(k+1)/C_B(1) + k · c_draft/C_B(1)),
with C_B measured once per model, device and thread count (cached on disk). E(k), the tokens a
pass yields, comes from the acceptance measured at each draft position given the previous one was
accepted: E(k) = 1 + Σ_i Π_{j≤i} a_j, over a memory of about 20 steps. An n-gram lookup's drafts
are either wrong at once or right for a long copied run; a quickly-moving single α switched it off
after a few misses and then missed the copy runs (measured, bf16 batch 1: drafting on 17% of steps,
1.14× where fixed k = 4 made 1.44×).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculant.speedup import CostCurve, measure_cost_curve, speedup_from

# Gains below this are noise on a shared CPU: not worth the risk of a loss.
MIN_GAIN = 1.05
# In a batch the model overestimates: measured 0.07-0.27 under its prediction (fp32 bench, fixed k = 2,
# batch 2-32: ragged rows, per-row work it leaves out). Below this it cannot tell a gain from a loss.
MIN_GAIN_BATCHED = 1.25
MAX_PROBE_INTERVAL = 64
CURVE_VERSION = 2  # cached curves of an older measurement are measured again


@dataclass
class AdaptiveK:
    curve: CostCurve
    k_max: int
    alpha: float = 0.6  # prior acceptance of the first draft, until drafts are seen
    draft_ratio: float = 0.0  # c_draft / C(1), per drafted position, tracked online
    coverage: float = 1.0  # share of rows asked for drafts that got some (n-gram lookup finds no match)
    memory: float = 0.95  # weight kept by past observations at each new step (~20 steps)
    prior_weight: float = 2.0  # the prior counts as this many drafts at each position
    smoothing: float = 0.15
    probe_every: int = 16  # while off, draft after n idle steps to keep the acceptance current
    reached: list[float] = field(default_factory=list)  # per position: drafts whose predecessors were kept
    kept: list[float] = field(default_factory=list)  # per position: of those, accepted
    _idle_steps: int = 0
    _probe_interval: int = 0

    def __post_init__(self):
        self._probe_interval = self.probe_every
        self.reached = self.reached or [0.0] * self.k_max
        self.kept = self.kept or [0.0] * self.k_max

    def acceptance(self) -> list[float]:
        """a_i: P(draft i accepted | drafts 1..i-1 accepted), what was seen blended with a prior: α for
        the first position, the previous position's estimate for the others (a position never
        reached stays as good as the one before it, no better)."""
        out, prior = [], self.alpha
        for reached, kept in zip(self.reached, self.kept):
            prior = (kept + self.prior_weight * prior) / (reached + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, k: int, acceptance: list[float] | None = None) -> float:
        acceptance = self.acceptance() if acceptance is None else acceptance
        total, run = 1.0, 1.0
        for a in acceptance[:k]:
            run *= a
            total += run
        return total

    def choose(self, batch_size: int) -> int:
        k, _ = self.best(batch_size)
        if k:
            self._idle_steps, self._probe_interval = 0, self.probe_every
            return k
        self._idle_steps += 1
        if self._idle_steps >= self._probe_interval and self.best(batch_size, [1.0] * self.k_max)[0]:
            # Speculation could pay if acceptance rose: measure it. A probe that does not turn it back
            # on doubles the wait, so a batch where it loses pays next to nothing for probing.
            self._idle_steps = 0
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            return min(2, self.k_max)
        return 0

    def best(self, batch_size: int, acceptance: list[float] | None = None) -> tuple[int, float]:
        """The k with the best predicted speed-up at this batch size (0 when none gains MIN_GAIN). A
        row without a draft yields one token; the pass is widened as soon as any row drafts."""
        acceptance = self.acceptance() if acceptance is None else acceptance
        widened = 1 - (1 - self.coverage) ** batch_size
        scored = [(speedup_from(self.expected_tokens(k, acceptance), k, self.curve.ratio(batch_size, k + 1),
                                self.draft_ratio, self.coverage, widened), k)
                  for k in range(1, self.k_max + 1)]
        gain, k = max(scored)
        return (k, gain) if gain >= (MIN_GAIN if batch_size == 1 else MIN_GAIN_BATCHED) else (0, 1.0)

    def observe(self, n_draft: list[int], n_accepted: list[int], draft_s: float, batch_size: int) -> None:
        """After a step that asked every row for drafts: each row's drafted and accepted counts."""
        covered = sum(n > 0 for n in n_draft) / len(n_draft)
        self.coverage += self.smoothing * (covered - self.coverage)
        if not any(n_draft):
            return
        self.reached = [r * self.memory for r in self.reached]
        self.kept = [c * self.memory for c in self.kept]
        for drafted, accepted in zip(n_draft, n_accepted):
            for i in range(min(drafted, accepted + 1, self.k_max)):
                self.reached[i] += 1
                self.kept[i] += i < accepted
        ratio = draft_s / max(n_draft) / self.curve.cost(batch_size, 1)
        self.draft_ratio += self.smoothing * (ratio - self.draft_ratio)


def cost_curve_for(model: torch.nn.Module, max_batch_size: int, max_width: int,
                   cache_dir: Path | None = None) -> CostCurve:
    """The model's cost curve at batch sizes 1, 2, 4 … max_batch_size, measured once and cached:
    it depends on the weights' shape, dtype, device and thread count, not on their values."""
    batch_sizes = sorted({min(2 ** i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})
    cfg = model.cfg
    key = json.dumps([CURVE_VERSION, cfg.__dict__, str(model.dtype), str(model.device), torch.get_num_threads(),
                      torch.__version__, batch_sizes, max_width, type(model.lm_head).__name__], sort_keys=True,
                     default=str)
    root = cache_dir or Path(os.environ.get("SPECULANT_CACHE", Path.home() / ".cache" / "speculant"))
    path = root / "cost_curves" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
    if path.exists():
        return CostCurve.from_dict(json.loads(path.read_text()))
    curve = measure_cost_curve(model, batch_sizes, max_width=max_width, context=128, reps=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve.as_dict()))
    tmp.rename(path)
    return curve
