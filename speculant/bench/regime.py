"""Is the target memory-bound, and what should speculation buy? The verdict in plain words and
the fit of the speed-up model (speculant/speedup.py) to measured runs."""

from __future__ import annotations

from dataclasses import dataclass

from speculant.speedup import MEMORY_BOUND_RATIO, CostCurve, fit_alpha, predicted_speedup

# The verify width the verdict is stated for: k = 4 drafts plus the one token a pass always yields.
VERDICT_WIDTH = 5
# Predicted gains below this are within this machine's measurement noise: advise k = 0 there.
MIN_WORTHWHILE_SPEEDUP = 1.05


# -- the verdict in plain words ------------------------------------------------------------------


def memory_bound_limit(curve: CostCurve, width: int = VERDICT_WIDTH) -> int | None:
    """The largest measured batch size up to which every measured batch verifies `width` tokens
    for at most MEMORY_BOUND_RATIO × C(1); None when batch 1 already fails."""
    limit = None
    for b in curve.batch_sizes:
        if curve.ratio(b, min(width, curve.max_width)) > MEMORY_BOUND_RATIO:
            break
        limit = b
    return limit


def regime_rule(width: int = VERDICT_WIDTH) -> str:
    return (f"rule: a batch size is memory-bound when one pass over {width} tokens per sequence "
            f"(k = {width - 1} drafts) costs at most {MEMORY_BOUND_RATIO}× a pass over 1, "
            f"C({width})/C(1) ≤ {MEMORY_BOUND_RATIO}")


def regime_verdict(curve: CostCurve, width: int = VERDICT_WIDTH) -> str:
    """One sentence: memory-bound up to which batch size, with the measured ratios that say so."""
    width = min(width, curve.max_width)
    limit = memory_bound_limit(curve, width)
    ratios = ", ".join(f"B={b}: {curve.ratio(b, width):.2f}" for b in curve.batch_sizes)
    largest = curve.batch_sizes[-1]
    if limit is None:
        head = ("compute-bound already at batch 1: each verified draft costs real time, so only drafts that "
                "are usually right and cheap to make pay (adaptive k verifies those alone)")
    elif limit == largest:
        head = f"memory-bound at every measured batch size (up to {largest}): verifying drafts is nearly free"
    else:
        head = (f"memory-bound up to batch {limit}, compute-bound beyond: speculation pays at small "
                f"batches and must shrink k or switch off above {limit}")
    return f"{head} (C({width})/C(1): {ratios})"


# -- fitting the model to a measured run and advising k ----------------------------------------


@dataclass
class AcceptanceFit:
    """What a measured speculative run says about its proposer, in the model's terms."""

    alpha: float  # per-token acceptance, fitted so E(α, k_mean) = mean acceptance length
    coverage: float  # share of sequence-steps that carried a draft
    k_mean: float  # drafted tokens per drafting step
    k: int  # the configured k
    draft_cost_ratio: float  # seconds per drafted token / C(1)
    extra_width: float = 0.0  # tokens a drafting step verifies beyond its drafts (a draft tree's other candidates)

    @classmethod
    def from_stats(cls, stats: dict, k: int, draft_s: float, steps: int, c1_s: float,
                   extra_width: int = 0) -> AcceptanceFit:
        """From a run's summed SpecStats.as_dict(), its draft seconds and engine steps, and C(1) (seconds
        per plain step) for the same setup. The draft cost is per pass and per drafting position, so
        coverage · k · c_draft is the draft time of one pass, whatever the batch size."""
        drafts, drafted = stats["num_drafts"], stats["num_draft_tokens"]
        if not drafts:
            return cls(0.0, 0.0, float(k), k, 0.0, extra_width)
        k_mean = drafted / drafts
        coverage = drafts / max(stats["target_passes"], 1)
        mal = 1 + stats["num_accepted_tokens"] / drafts
        draft_per_pass = draft_s / max(steps, 1)
        return cls(fit_alpha(mal, k_mean), coverage, k_mean, k,
                   draft_per_pass / (coverage * k_mean) / c1_s if c1_s > 0 else 0.0, extra_width)

    def predict(self, curve: CostCurve, batch_size: int, k: int | None = None) -> float:
        """Predicted speed-up at this batch size with k drafts (default: the measured k); a
        proposer's drafts scale with k as measured (k_mean / k of them are filled)."""
        k = self.k if k is None else k
        if k == 0 or self.coverage == 0:
            return 1.0
        k_eff = self.k_mean * k / self.k
        widened = 1 - (1 - self.coverage) ** batch_size
        return predicted_speedup(self.alpha, k_eff, curve.ratio(batch_size, k_eff + 1 + self.extra_width),
                                 self.draft_cost_ratio, self.coverage, widened)

    def best_k(self, curve: CostCurve, batch_size: int, max_k: int = 8) -> tuple[int, float]:
        """The k with the highest predicted speed-up, or (0, 1.0) when none clears the noise."""
        k, s = max(((k, self.predict(curve, batch_size, k)) for k in range(1, max_k + 1)),
                   key=lambda ks: ks[1])
        return (k, s) if s >= MIN_WORTHWHILE_SPEEDUP else (0, 1.0)

    def as_dict(self) -> dict:
        return dict(self.__dict__)
