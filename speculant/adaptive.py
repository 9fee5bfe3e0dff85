"""Adaptive speculation: choose how many drafts each step verifies from the target's measured cost
curve and the running acceptance, and switch speculation off where it would lose (large batches,
drafts that keep missing).

The choice maximises DESIGN.md §3's predicted speed-up
    S(k) = E(k) / (C_B(k+1)/C_B(1) + k · c_draft/C_B(1)),
with C_B measured once per model, device and thread count (cached on disk). E(k), the tokens a
pass yields, comes from the acceptance measured at each draft position given the previous one was
accepted: E(k) = 1 + Σ_i Π_{j≤i} a_j, over a memory of about 20 steps. An n-gram lookup's drafts
are either wrong at once or right for a long copied run; a quickly-moving single α switched it off
after a few misses and then missed the copy runs (measured, bf16 batch 1: drafting on 17% of steps,
1.14× where fixed k = 4 made 1.44×).

Acceptance is kept per bucket, a proposer's own hint of how good a row's drafts are: for n-gram
lookup, the length of the suffix that matched. Measured on the bundled prompts (SmolLM2, greedy,
up to 4 drafts): a 1-token match gets its first draft accepted 16–26% of the time, a 4-token match
88–90% (3.1 of 4 drafts kept), whatever the prompt class. One acceptance for all switched lookup off
after a run of short matches and lost the long ones (0.93× on rewrites, where fixed k made 1.28×).

Two ways in: a proposer whose drafts cost a model pass is asked for `choose()` drafts; one whose
drafts cost nothing (lookup) proposes all it can and `plan()` says how many of them to verify.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculant.models import native
from speculant.proposers.base import MODEL_BUCKET
from speculant.speedup import CostCurve, measure_cost_curve, speedup_from

# Gains below this are noise on a shared CPU: not worth the risk of a loss.
MIN_GAIN = 1.05
# In a batch the model overestimates: measured 0.07-0.27 under its prediction (fp32 bench, fixed k = 2,
# batch 2-32: ragged rows, per-row work it leaves out). Below this it cannot tell a gain from a loss: at
# 1.25, once int4's wide passes got cheaper, batch 4 widened 11% of its steps for 0.92x plain (two bench
# runs); at 1.4, 4% of them, 0.95-0.96x.
MIN_GAIN_BATCHED = 1.4
MAX_PROBE_INTERVAL = 64
MAX_SKIPPED = 8  # steps a batch goes without looking for drafts after a step that drafted none
PROBE_WIDTH = 2
# The widening cost measured in this run may scale the curve's by this much, no more: a few noisy
# steps must not make wide passes look free, nor switch speculation off for good.
CALIBRATION_RANGE = (0.5, 1.5)
CALIBRATION_MIN_PASSES = 8  # of each width compared, plain passes included
# The weight a new request leaves to what the drafts of earlier requests showed (at batch 1): their texts
# may suit a drafter better or worse than its own.
REQUEST_MEMORY = 0.1
CURVE_VERSION = 10  # cached curves of an older measurement or model code (10: weights in huge pages) are measured again


@dataclass
class Bucket:
    """What was seen of one bucket's drafts, decayed, and when it was last verified."""
    reached: list[float]  # per position: drafts whose predecessors were kept
    kept: list[float]  # per position: of those, accepted
    probe_interval: int
    idle_steps: int = 0


@dataclass
class AdaptiveK:
    curve: CostCurve
    k_max: int
    alpha: float = 0.6  # prior acceptance of the first draft, until drafts are seen
    draft_ratio: float = 0.0  # c_draft / C(1), per drafted position, tracked online
    memory: float = 0.95  # weight kept by past observations at each step that verifies a bucket (~20)
    prior_weight: float = 1.0  # the prior counts as this many drafts at each position
    smoothing: float = 0.15
    probe_every: int = 16  # while a bucket is off, verify its drafts after n idle steps to keep it current
    buckets: dict[int, Bucket] = field(default_factory=dict)
    # pass width → [passes seen, decayed mean seconds]: the engine's own pass times at batch 1
    pass_times: dict[int, list[float]] = field(default_factory=dict)
    skipped: int = 0  # steps the last look-up-free stretch lasted (worth_proposing)
    skip_left: int = 0
    model_drafted: bool = False  # the last step verified a model's drafts
    # Nodes a model's drafts bring beyond k (a draft tree's other first candidates): they widen the pass.
    extra_nodes: int = 0

    def bucket(self, key: int) -> Bucket:
        if key not in self.buckets:
            self.buckets[key] = Bucket([0.0] * self.k_max, [0.0] * self.k_max, self.probe_every)
        return self.buckets[key]

    def acceptance(self, key: int = 0) -> list[float]:
        """a_i: P(draft i accepted | drafts 1..i-1 accepted) in a bucket, what was seen blended with a
        prior: α for the first position, the previous position's estimate for the others (a position
        never reached stays as good as the one before it, no better)."""
        b = self.bucket(key)
        out, prior = [], self.alpha
        for reached, kept in zip(b.reached, b.kept):
            prior = (kept + self.prior_weight * prior) / (reached + self.prior_weight)
            out.append(prior)
        return out

    def choose(self, batch_size: int, remaining: list[int] | None = None) -> int:
        """How many drafts to ask of a proposer whose drafts cost a pass of its own. While it is off
        it is probed at batch 1 only: in a batch a probe runs the model for every row and widens
        every row's pass, and what it learns, the drafts' acceptance, does not depend on the batch
        size (measured, EAGLE head with lookup first, int4, batch 16: two probes in 48 steps, 0.90x
        plain)."""
        buckets, available = [MODEL_BUCKET] * batch_size, [self.k_max] * batch_size
        return self._width(buckets, available, self.draft_ratio, remaining, probe=batch_size == 1)

    def worth_proposing(self, batch_size: int) -> bool:
        """Whether a free proposer should look for drafts this step. In a batch, after a step whose
        drafts were all left out the next 1, 2, 4 … MAX_SKIPPED steps do not look (each counts as an
        idle step for the probes), until a step drafts again: looking up and planning cost ~3% of a
        batch-32 step (int4) where speculation widened 1% of the steps."""
        if batch_size == 1 or self.skip_left == 0:
            return True
        self.skip_left -= 1
        for b in self.buckets.values():
            b.idle_steps += 1
        return False

    def new_request(self) -> None:
        """A request starts alone (batch 1). Without this, a drafter turned off on one request stayed off
        for the next ones, its acceptance seen only by rare probes (bench, int4, code at 48 tokens: the
        EAGLE head off on 51% of steps, 1.09× where fixed k = 2 made 1.29×): each bucket keeps
        REQUEST_MEMORY of its evidence, so the prior and the request's own drafts weigh in, and a bucket
        that is off is probed at once."""
        for b in self.buckets.values():
            b.reached = [r * REQUEST_MEMORY for r in b.reached]
            b.kept = [c * REQUEST_MEMORY for c in b.kept]
            b.probe_interval = b.idle_steps = self.probe_every

    def keep_lookup(self, buckets: list[int], available: list[int]) -> list[int]:
        """Lookup first (proposers/lookup_first.py): each row's available lookup drafts, or 0 where the
        model's drafts promise more. Judged per row as if alone, at batch 1: the question is which
        drafter to trust for the row; plan() and choose() then size the pass for the batch."""
        _, model_gain = self.best([MODEL_BUCKET], [self.k_max], self.draft_ratio)
        gains: dict[tuple[int, int], float] = {}
        for key, n in zip(buckets, available):
            if n and (key, n) not in gains:
                gains[key, n] = self.best([key], [n])[1]
        return [n if n and gains[key, n] >= model_gain else 0 for key, n in zip(buckets, available)]

    def plan(self, buckets: list[int], available: list[int], draft_ratio: float = 0.0,
             remaining: list[int] | None = None) -> list[int]:
        """How many of its `available` drafts each row sends to the verify pass. The pass is as wide as
        its widest row, and every row fills it up to that width: a widened pass costs the same
        whatever fills it. `remaining`: each row's tokens left to its limit when no request waits for
        a slot (see batch_progress); None when one does."""
        width = self._width(buckets, available, draft_ratio, remaining)
        if width or len(buckets) == 1:
            self.skipped = self.skip_left = 0
        else:
            self.skipped = min(2 * self.skipped or 1, MAX_SKIPPED)
            self.skip_left = self.skipped
        return [min(width, n) for n in available]

    def _width(self, buckets: list[int], available: list[int], draft_ratio: float,
               remaining: list[int] | None, probe: bool = True) -> int:
        """The pass width plan() and choose() settle on: the best one, else a probe, else 0."""
        width, _ = self.best(buckets, available, draft_ratio, remaining=remaining)
        drafting = {key for key, n in zip(buckets, available) if n}
        if not width:
            return self._probe(buckets, available, draft_ratio, drafting, remaining) if probe else 0
        for key in drafting:
            b = self.bucket(key)
            b.idle_steps, b.probe_interval = 0, self.probe_every
        return width

    def _probe(self, buckets: list[int], available: list[int], draft_ratio: float, drafting: set[int],
               remaining: list[int] | None) -> int:
        """While a bucket is off, its acceptance is not seen: verify its drafts now and then, if this
        step would pay were all of them accepted (in a large batch, a few rows' drafts never pay: a
        probe there only costs). A probe that does not turn it back on doubles its wait."""
        due = []
        for key in drafting:
            b = self.bucket(key)
            b.idle_steps += 1
            if b.idle_steps >= b.probe_interval and self.best(buckets, available, draft_ratio, {key}, remaining)[0]:
                due.append(key)
        if not due:
            return 0
        for key in due:
            b = self.bucket(key)
            b.idle_steps, b.probe_interval = 0, min(2 * b.probe_interval, MAX_PROBE_INTERVAL)
        return min(PROBE_WIDTH, self.k_max)

    def best(self, buckets: list[int], available: list[int], draft_ratio: float = 0.0,
             optimistic: set[int] = frozenset(), remaining: list[int] | None = None) -> tuple[int, float]:
        """The pass width (drafts per row) with the best predicted speed-up for a batch whose row b
        has available[b] drafts from bucket buckets[b]; 0 when none gains MIN_GAIN. A row without a
        draft yields one token but pays for the widened pass all the same. Drafts of the `optimistic`
        buckets count as all accepted; `remaining` as in plan()."""
        expected = {key: expected_tokens_upto([1.0] * self.k_max if key in optimistic else self.acceptance(key))
                    for key in set(buckets)}
        batch = len(buckets)
        extra = self.extra_nodes if any(n and key == MODEL_BUCKET for key, n in zip(buckets, available)) else 0
        scale = self.calibration(batch)
        fixed_share = min(self.curve.cost(1, 1) / self.curve.cost(batch, 1), 1.0)
        catch_up = None if remaining is None or batch == 1 else [max(remaining) / max(r, 1) for r in remaining]
        scored = [(0.0, 0)]
        for k in range(1, min(max(available, default=0), self.k_max) + 1):
            drafts = [min(k, n) for n in available]
            tokens = batch_progress([expected[key][n] for key, n in zip(buckets, drafts)], catch_up, fixed_share)
            ratio = 1 + scale * (self.curve.ratio(batch, k + 1 + extra) - 1)
            scored.append((speedup_from(tokens, sum(drafts) / batch, ratio, draft_ratio), k))
        gain, k = max(scored)
        return (k, gain) if gain >= (MIN_GAIN if batch == 1 else MIN_GAIN_BATCHED) else (0, 1.0)

    def calibration(self, batch_size: int) -> float:
        """How the widening cost of this run's passes compares with the curve's: C_B(w)/C_B(1) − 1 is
        taken as this factor × the curve's. The curve is the fastest of a few repetitions, measured
        once; on a shared machine a pass typically costs more, and not in proportion: at batch 1
        (int4) fixed k = 4 gained 1.57× where the curve predicted 1.27×, and adaptive k had skipped
        drafts that would have paid.

        Σ (measured − 1) / Σ (curve − 1) over the widened pass widths seen at batch 1, each
        C(w)/C(1) with enough passes of both; 1 until then, clamped to CALIBRATION_RANGE. Batch 1 only:
        in batches few passes are widened and the factor came out low on too few of them (bench, bf16
        batch 8: drafting where the measured acceptance predicted 0.86×, 0.92× measured)."""
        plain = self.pass_times.get(1)
        if batch_size > 1 or plain is None or plain[0] < CALIBRATION_MIN_PASSES:
            return 1.0
        measured = expected = 0.0
        for width, (n, seconds) in self.pass_times.items():
            if width > 1 and n >= CALIBRATION_MIN_PASSES:
                measured += seconds / plain[1] - 1
                expected += self.curve.ratio(1, width) - 1
        if expected <= 0:
            return 1.0
        low, high = CALIBRATION_RANGE
        return min(max(measured / expected, low), high)

    def observe_pass(self, batch_size: int, width: int, seconds: float) -> None:
        """A target pass of this width (1: plain) took `seconds`, as the engine measured it (kept at
        batch 1, the only batch size calibrated)."""
        if batch_size > 1:
            return
        n_mean = self.pass_times.setdefault(width, [0, 0.0])
        n_mean[0] += 1
        # The mean of the first passes, then a decayed one (~20 passes): the machine's load drifts.
        n_mean[1] += (seconds - n_mean[1]) * max(1 - self.memory, 1 / n_mean[0])

    def observe(self, buckets: list[int], n_draft: list[int], n_accepted: list[int], draft_s: float,
                batch_size: int, pass_s: float | None = None, width: int | None = None) -> None:
        """After every step: each row's bucket, verified drafts (none on a plain step; a draft tree's
        depth) and accepted count; the time spent drafting and, when known, the verify pass's own time
        and width (default: the most drafts + 1)."""
        for key in {key for key, n in zip(buckets, n_draft) if n}:
            b = self.bucket(key)
            b.reached = [r * self.memory for r in b.reached]
            b.kept = [c * self.memory for c in b.kept]
        for key, drafted, accepted in zip(buckets, n_draft, n_accepted):
            if not drafted:  # observe() runs every step: plain rows have nothing to record
                continue
            b = self.bucket(key)
            for i in range(min(drafted, accepted + 1, self.k_max)):
                b.reached[i] += 1
                b.kept[i] += i < accepted
        # Only a model's drafts cost time (a lookup's are free): the longest of them set the step's. A
        # model that sat out the step before first reads every token it missed (measured, EAGLE head with
        # lookup first, int4: 5.5 ms after ~80 tokens it missed, 2.3 ms for one draft on the step after a
        # drafting one), a cost paid once per stretch: a draft's cost is measured on consecutive
        # drafting steps only.
        model_drafts = max((n for key, n in zip(buckets, n_draft) if key == MODEL_BUCKET), default=0)
        steady, self.model_drafted = self.model_drafted, bool(model_drafts)
        if model_drafts and steady:
            # Against this run's own pass (scaled to one token by the curve): the curve's C(1) is the
            # fastest of a few passes measured once, and the machine's speed drifts (measured: 11.5 ms
            # in the curve, 9.0 ms in the run, which made a draft look 22% cheaper than it was).
            width = width or max(n_draft) + 1
            one_token = self.curve.cost(batch_size, 1) if pass_s is None else pass_s / self.curve.ratio(batch_size,
                                                                                                       width)
            ratio = draft_s / model_drafts / one_token
            self.draft_ratio += self.smoothing * (ratio - self.draft_ratio)


def batch_progress(tokens: list[float], catch_up: list[float] | None, fixed_share: float) -> float:
    """What a pass yielding tokens[b] to row b is worth, in tokens per row.

    While requests wait for a slot (catch_up None), every token counts alike: the mean (a row that
    finishes early takes the next request in). When none waits, a pass costs a part that does not
    depend on the rows (`fixed_share` of it: streaming the weights) and a part per row; the first is
    paid until the last row is done, so it is worth the progress of the row furthest behind,
    min_b tokens[b] · catch_up[b] with catch_up[b] = r_max / r_b (r_b: the tokens row b has left), the
    second the mean. Measured (int4, batch 8, 48 tokens each, no queue, the mean alone): drafts for a
    few rows cost their widened passes and saved no step, 48 steps either way, 0.88× plain."""
    mean = sum(tokens) / len(tokens)
    if catch_up is None:
        return mean
    return fixed_share * min(t * c for t, c in zip(tokens, catch_up)) + (1 - fixed_share) * mean


def expected_tokens_upto(acceptance: list[float]) -> list[float]:
    """E(k) for k = 0 … len(acceptance): the tokens a pass yields with k drafts, 1 + Σ_i Π_{j≤i} a_j."""
    out, run = [1.0], 1.0
    for a in acceptance:
        run *= a
        out.append(out[-1] + run)
    return out


def cost_curve_for(model: torch.nn.Module, max_batch_size: int, max_width: int,
                   cache_dir: Path | None = None) -> CostCurve:
    """The model's cost curve at batch sizes 1, 2, 4 … max_batch_size, measured once and cached:
    it depends on the weights' shape, dtype, device and thread count and on the kernels, not on the
    weights' values."""
    batch_sizes = sorted({min(2 ** i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})
    cfg = model.cfg
    key = json.dumps([CURVE_VERSION, cfg.__dict__, str(model.dtype), str(model.device), torch.get_num_threads(),
                      torch.__version__, batch_sizes, max_width, type(model.lm_head).__name__,
                      os.environ.get(native.SWITCH_ENV, "on"), native.source_digest(), model.narrow_passes],
                     sort_keys=True, default=str)
    root = cache_dir or Path(os.environ.get("SPECULANT_CACHE", Path.home() / ".cache" / "speculant"))
    path = root / "cost_curves" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
    if path.exists():
        return CostCurve.from_dict(json.loads(path.read_text()))
    curve = measure_cost_curve(model, batch_sizes, max_width=max_width, context=128)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve.as_dict()))
    tmp.rename(path)
    return curve
