"""Adaptive speculation: choose k each step from the target's measured cost curve and the
running acceptance rate, and switch speculation off where it would lose (large batches,
proposers that keep missing).

The choice maximises DESIGN.md §3's predicted speed-up
    S(k) = E(α, k) / (C_B(k+1)/C_B(1) + k · c_draft/C_B(1)),
with C_B measured once per model, device and thread count (cached on disk) and α, c_draft
tracked online.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from speculant.speedup import CostCurve, fit_alpha, measure_cost_curve, predicted_speedup

# Gains below this are noise on a shared CPU: not worth the risk of a loss.
MIN_GAIN = 1.05
MAX_PROBE_INTERVAL = 256


@dataclass
class AdaptiveK:
    curve: CostCurve
    k_max: int
    alpha: float = 0.6  # prior acceptance until drafts are seen
    draft_ratio: float = 0.0  # c_draft / C(1), per drafted position, tracked online
    smoothing: float = 0.15
    probe_every: int = 16  # while off, draft after n idle steps to keep α current
    _idle_steps: int = 0
    _probe_interval: int = 0

    def __post_init__(self):
        self._probe_interval = self.probe_every

    def choose(self, batch_size: int) -> int:
        k, gain = self.best(batch_size, self.alpha)
        if k:
            self._idle_steps, self._probe_interval = 0, self.probe_every
            return k
        self._idle_steps += 1
        if self._idle_steps >= self._probe_interval and self.best(batch_size, 1.0)[0]:
            # Speculation could pay if acceptance rose: measure it. A probe that does not turn it back
            # on doubles the wait, so a batch where it loses pays next to nothing for probing.
            self._idle_steps = 0
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            return min(2, self.k_max)
        return 0

    def best(self, batch_size: int, alpha: float) -> tuple[int, float]:
        scored = [(predicted_speedup(alpha, k, self.curve.ratio(batch_size, k + 1), self.draft_ratio), k)
                  for k in range(1, self.k_max + 1)]
        gain, k = max(scored)
        return (k, gain) if gain >= MIN_GAIN else (0, 1.0)

    def observe(self, k: int, rows_drafting: int, accepted: int, draft_s: float, batch_size: int) -> None:
        """After a step that drafted k tokens for `rows_drafting` rows, `accepted` of them kept."""
        if not k or not rows_drafting:
            return
        alpha = fit_alpha(1 + accepted / rows_drafting, k)
        self.alpha += self.smoothing * (alpha - self.alpha)
        ratio = draft_s / k / self.curve.cost(batch_size, 1)
        self.draft_ratio += self.smoothing * (ratio - self.draft_ratio)


def cost_curve_for(model: torch.nn.Module, max_batch_size: int, max_width: int,
                   cache_dir: Path | None = None) -> CostCurve:
    """The model's cost curve at batch sizes 1, 2, 4 … max_batch_size, measured once and cached:
    it depends on the weights' shape, dtype, device and thread count, not on their values."""
    batch_sizes = sorted({min(2 ** i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})
    cfg = model.cfg
    key = json.dumps([cfg.__dict__, str(model.dtype), str(model.device), torch.get_num_threads(),
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
