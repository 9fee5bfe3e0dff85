"""Adaptive speculation: choose how many drafts each step verifies from the target's measured cost
curve and the running acceptance, and switch speculation off where it would lose (large batches,
drafts that keep missing).

The choice maximises the predicted speed-up of docs/design.md §3
    S(k) = E(k) / (C_B(k+1)/C_B(1) + k · c_draft/C_B(1)),
with C_B measured once per model, device and thread count (cached on disk). E(k), the tokens a
pass yields, comes from the acceptance measured at each draft position given the previous one was
accepted: E(k) = 1 + Σ_i Π_{j≤i} a_j, over a memory of about 20 steps. Per position, because an
n-gram lookup's drafts are either wrong at once or right for a long copied run: a single quickly-moving
α switched lookup off after a few misses and then missed the copies.

Acceptance is kept per bucket, a proposer's own hint of how good a row's drafts are: for n-gram
lookup, the length of the suffix that matched (a long match is right far more often than a 1-token
one, whatever the prompt). One acceptance for all switched lookup off after a run of short matches
and lost the long ones.

Two ways in, chosen by the proposer (Proposer.propose_adaptive): a proposer whose drafts cost a model
pass is asked for `choose()` drafts; one whose drafts cost nothing (lookup) finds all it can and
`plan()` says how many of them to verify. After the step the engine hands `observe()` one StepRecord.

The runs behind these choices and the constants below: docs/history.md ("Adaptive k").
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculant.models import gguf_file, native, notice
from speculant.speedup import CostCurve, measure_cost_curve, speedup_from

# Drafts are judged by the acceptance seen in their bucket: this one for drafts that cost a model pass, a lookup's
# match length (1 and up) for the others.
MODEL_BUCKET = 0
# Gains below this are noise on a shared CPU: not worth the risk of a loss.
MIN_GAIN = 1.05
# In a batch the model overestimates (ragged rows, per-row work it leaves out): below this predicted gain it
# cannot tell a gain from a loss.
MIN_GAIN_BATCHED = 1.4
MAX_PROBE_INTERVAL = 64
MAX_SKIPPED = 8  # steps a batch goes without looking for drafts after a step that drafted none
PROBE_WIDTH = 2
# Probes may cost at most this share of the steps they watch over: on a target whose wide passes are dear (routed
# experts: a pass of 3 tokens runs about their union), probing at every new request cost more than it found.
MAX_PROBE_SHARE = 0.005
# The widening cost measured in this run may scale the curve's by this much, no more: a few noisy
# steps must not make wide passes look free, nor switch speculation off for good.
CALIBRATION_RANGE = (0.5, 1.5)
CALIBRATION_MIN_PASSES = 8  # of each width compared, plain passes included
# The weight a new request leaves to what the drafts of earlier requests showed (at batch 1): their texts
# may suit a drafter better or worse than its own.
REQUEST_MEMORY = 0.1
DRAFT_COST_WINDOW = 9  # steady drafting steps whose median is the draft's cost
CURVE_VERSION = 10  # raised when the measurement or the model code changes: cached curves are measured again


@dataclass
class StepRecord:
    """One engine step, as the policy learns from it."""
    buckets: list[int]  # per row: its drafts' bucket (Proposal.bucket_list)
    drafted: list[int]  # per row: drafts it could have accepted (0 on a plain row; a tree's depth)
    accepted: list[int]  # per row: drafts accepted
    batch_size: int
    draft_s: float  # time spent proposing
    pass_s: float | None = None  # the verify pass's own time, when measured
    width: int | None = None  # tokens per row of that pass (default: the most drafts + 1)


@dataclass
class Bucket:
    """What was seen of one bucket's drafts, decayed, and when it was last verified."""
    reached: list[float]  # per position: drafts whose predecessors were kept
    kept: list[float]  # per position: of those, accepted
    probe_interval: int
    idle_steps: int = 0


@dataclass
class AdaptiveK:
    curve: CostCurve | None  # None: measured by load_curve when first needed
    k_max: int
    alpha: float = 0.6  # prior acceptance of the first draft, until drafts are seen
    draft_ratio: float = 0.0  # c_draft / C(1), per drafted position: the median of draft_costs once it has one
    memory: float = 0.95  # weight kept by past observations at each step that verifies a bucket (~20)
    prior_weight: float = 1.0  # the prior counts as this many drafts at each position
    # The last steady steps' draft costs. A median: one slow step (another process's burst) in a running
    # mean made the draft look dear enough to stay off, and a drafter that is off measures nothing.
    draft_costs: deque = field(default_factory=lambda: deque(maxlen=DRAFT_COST_WINDOW))
    probe_every: int = 16  # while a bucket is off, verify its drafts after n idle steps to keep it current
    buckets: dict[int, Bucket] = field(default_factory=dict)
    # pass width → [passes seen, decayed mean seconds]: the engine's own pass times at batch 1
    pass_times: dict[int, list[float]] = field(default_factory=dict)
    probe_debt: float = 0.0  # plain passes' worth of probing not yet paid for by MAX_PROBE_SHARE a step
    probe_estimate: float | None = None  # the debt charged for the probe under way, until its step is measured
    skipped: int = 0  # steps the last look-up-free stretch lasted (worth_proposing)
    skip_left: int = 0
    model_drafted: bool = False  # the last step verified a model's drafts
    # Nodes a model's drafts bring beyond k (a draft tree's other first candidates): they widen the pass.
    extra_nodes: int = 0
    # The same at each batch size (Proposer.extra_nodes_at); None: extra_nodes at all of them.
    extra_at: Callable[[int], int] | None = None
    # The smallest batch whose drafts it chooses and whose steps it learns from: a smaller one drafts the fixed
    # k. With from_batch 2 a run that never batches never measures the curve (seconds on a 1.5B).
    from_batch: int = 1
    load_curve: Callable[[], CostCurve] | None = None
    # best()'s answers since the acceptance last changed (emptied then: observe, new_request): while drafting is off
    # they are asked the same question every step, and at a small target's few milliseconds a pass recomputing
    # them cost 1-2 % of it.
    answers: dict = field(default_factory=dict)

    @property
    def costs(self) -> CostCurve:
        if self.curve is None:
            self.curve = self.load_curve()
        return self.curve

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
        size."""
        buckets, available = [MODEL_BUCKET] * batch_size, [self.k_max] * batch_size
        return self._width(buckets, available, self.draft_ratio, remaining, probe=batch_size == 1)

    def worth_proposing(self, batch_size: int) -> bool:
        """Whether a free proposer should look for drafts this step. In a batch, after a step whose
        drafts were all left out the next 1, 2, 4 … MAX_SKIPPED steps do not look (each counts as an
        idle step for the probes), until a step drafts again: in large batches speculation rarely pays,
        and looking up and planning every step would cost more than it finds."""
        if batch_size == 1 or self.skip_left == 0:
            return True
        self.skip_left -= 1
        for b in self.buckets.values():
            b.idle_steps += 1
        return False

    def new_request(self) -> None:
        """A request starts alone (batch 1). Without this, a drafter turned off on one request stayed off
        for the next ones, its acceptance seen only by rare probes: each bucket keeps REQUEST_MEMORY of
        its evidence, so the prior and the request's own drafts weigh in, and a bucket that is off is
        probed at once."""
        for b in self.buckets.values():
            b.reached = [r * REQUEST_MEMORY for r in b.reached]
            b.kept = [c * REQUEST_MEMORY for c in b.kept]
            b.probe_interval = b.idle_steps = self.probe_every
        self.answers.clear()
        self.joined()

    def joined(self) -> None:
        """A row joined the batch: its first draft reads its prompt's last chunk, a cost of the prompt and not
        of drafting, so that step does not count as a steady one (see observe)."""
        self.model_drafted = False

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
        self.probe_debt = max(self.probe_debt - MAX_PROBE_SHARE, 0.0)
        due = []
        for key in drafting:
            b = self.bucket(key)
            b.idle_steps += 1
            if (b.idle_steps >= b.probe_interval and self.probe_debt <= 0
                    and self.best(buckets, available, draft_ratio, {key}, remaining)[0]):
                due.append(key)
        if not due:
            return 0
        width = min(PROBE_WIDTH, self.k_max)
        for key in due:
            b = self.bucket(key)
            b.idle_steps, b.probe_interval = 0, min(2 * b.probe_interval, MAX_PROBE_INTERVAL)
        # What the probe costs beyond a plain step: the wider pass and the drafts (observe() puts the measured
        # cost in its place, which includes a draft model catching up on the tokens it sat out).
        self.probe_estimate = self.costs.ratio(len(buckets), width + 1) - 1 + width * draft_ratio
        self.probe_debt += self.probe_estimate
        return width

    def best(self, buckets: list[int], available: list[int], draft_ratio: float = 0.0,
             optimistic: set[int] = frozenset(), remaining: list[int] | None = None) -> tuple[int, float]:
        """The pass width (drafts per row) with the best predicted speed-up for a batch whose row b
        has available[b] drafts from bucket buckets[b]; 0 when none gains MIN_GAIN. A row without a
        draft yields one token but pays for the widened pass all the same. Drafts of the `optimistic`
        buckets count as all accepted; `remaining` as in plan()."""
        batch = len(buckets)
        extra = 0
        if any(n and key == MODEL_BUCKET for key, n in zip(buckets, available)):
            extra = self.extra_nodes if self.extra_at is None else self.extra_at(batch)
        scale = self.calibration(batch)
        # The calibration drifts a little every step (the plain pass's time): to 2 decimals it is the same answer.
        question = (tuple(buckets), tuple(available), draft_ratio, frozenset(optimistic), extra, round(scale, 2),
                    None if remaining is None or batch == 1 else tuple(remaining), self.alpha)
        if question not in self.answers:
            if len(self.answers) > 64:  # batches' questions differ by their rows' remaining tokens
                self.answers.clear()
            self.answers[question] = self._best(buckets, available, draft_ratio, optimistic, remaining, extra, scale)
        return self.answers[question]

    def _best(self, buckets: list[int], available: list[int], draft_ratio: float, optimistic: set[int],
              remaining: list[int] | None, extra: int, scale: float) -> tuple[int, float]:
        expected = {key: expected_tokens_upto([1.0] * self.k_max if key in optimistic else self.acceptance(key))
                    for key in set(buckets)}
        batch = len(buckets)
        fixed_share = min(self.costs.cost(1, 1) / self.costs.cost(batch, 1), 1.0)
        catch_up = None if remaining is None or batch == 1 else [max(remaining) / max(r, 1) for r in remaining]
        scored = [(0.0, 0)]
        for k in range(1, min(max(available, default=0), self.k_max) + 1):
            drafts = [min(k, n) for n in available]
            tokens = batch_progress([expected[key][n] for key, n in zip(buckets, drafts)], catch_up, fixed_share)
            ratio = 1 + scale * (self.costs.ratio(batch, k + 1 + extra) - 1)
            scored.append((speedup_from(tokens, sum(drafts) / batch, ratio, draft_ratio), k))
        gain, k = max(scored)
        return (k, gain) if gain >= (MIN_GAIN if batch == 1 else MIN_GAIN_BATCHED) else (0, 1.0)

    def calibration(self, batch_size: int) -> float:
        """How the widening cost of this run's passes compares with the curve's: C_B(w)/C_B(1) − 1 is
        taken as this factor × the curve's. The curve is the fastest of a few repetitions, measured
        once; on a shared machine a pass typically costs more, and not in proportion, and without this
        adaptive k skipped drafts that would have paid.

        Σ (measured − 1) / Σ (curve − 1) over the widened pass widths seen at batch 1, each
        C(w)/C(1) with enough passes of both; 1 until then, clamped to CALIBRATION_RANGE. Batch 1 only:
        in batches few passes are widened and the factor came out low on too few of them."""
        plain = self.pass_times.get(1)
        if batch_size > 1 or plain is None or plain[0] < CALIBRATION_MIN_PASSES:
            return 1.0
        measured = expected = 0.0
        for width, (n, seconds) in self.pass_times.items():
            if width > 1 and n >= CALIBRATION_MIN_PASSES:
                measured += seconds / plain[1] - 1
                expected += self.costs.ratio(1, width) - 1
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

    def charge_probe(self, step: StepRecord) -> None:
        """The probe's step measured against this run's plain pass: its excess is the debt, not the estimate.
        Plain passes are timed at batch 1 only (observe_pass): a probe in a batch keeps the curve's estimate."""
        estimate, self.probe_estimate = self.probe_estimate, None
        plain = self.pass_times.get(1)
        if estimate is None or step.pass_s is None or step.batch_size > 1 or plain is None or not plain[1]:
            return
        measured = (step.draft_s + step.pass_s) / plain[1] - 1
        self.probe_debt = max(self.probe_debt + measured - estimate, 0.0)

    def observe(self, step: StepRecord) -> None:
        """What one step drafted, kept and cost."""
        if step.pass_s is not None:
            self.observe_pass(step.batch_size, step.width or max(step.drafted, default=0) + 1, step.pass_s)
        self.charge_probe(step)
        if any(step.drafted):
            self.answers.clear()
        for key in {key for key, n in zip(step.buckets, step.drafted) if n}:
            b = self.bucket(key)
            b.reached = [r * self.memory for r in b.reached]
            b.kept = [c * self.memory for c in b.kept]
        for key, drafted, accepted in zip(step.buckets, step.drafted, step.accepted):
            if not drafted:  # a plain row has nothing to record
                continue
            b = self.bucket(key)
            for i in range(min(drafted, accepted + 1, self.k_max)):
                b.reached[i] += 1
                b.kept[i] += i < accepted
        # Only a model's drafts cost time (a lookup's are free): the longest of them set the step's. A
        # model that sat out the step before first reads every token it missed, a cost paid once per
        # stretch: a draft's cost is measured on consecutive drafting steps only.
        model_drafts = max((n for key, n in zip(step.buckets, step.drafted) if key == MODEL_BUCKET), default=0)
        steady, self.model_drafted = self.model_drafted, bool(model_drafts)
        if model_drafts and steady:
            # Against this run's own pass (scaled to one token by the curve), not the curve's C(1): that is
            # the fastest of a few passes measured once, and the machine's speed drifts.
            width = step.width or max(step.drafted) + 1
            one_token = (self.costs.cost(step.batch_size, 1) if step.pass_s is None
                         else step.pass_s / self.costs.ratio(step.batch_size, width))
            self.draft_costs.append(step.draft_s / model_drafts / one_token)
            self.draft_ratio = statistics.median(self.draft_costs)


def batch_progress(tokens: list[float], catch_up: list[float] | None, fixed_share: float) -> float:
    """What a pass yielding tokens[b] to row b is worth, in tokens per row.

    While requests wait for a slot (catch_up None), every token counts alike: the mean (a row that
    finishes early takes the next request in). When none waits, a pass costs a part that does not
    depend on the rows (`fixed_share` of it: streaming the weights) and a part per row; the first is
    paid until the last row is done, so it is worth the progress of the row furthest behind,
    min_b tokens[b] · catch_up[b] with catch_up[b] = r_max / r_b (r_b: the tokens row b has left), the
    second the mean. With the mean alone, drafts for a few rows of a batch cost their widened passes and
    saved no step."""
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
    path = gguf_file.cache_dir(cache_dir) / "cost_curves" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
    if path.exists():
        return CostCurve.from_dict(json.loads(path.read_text()))
    reps = 5
    tick = notice.Countdown("measuring the target's cost per pass width, cached for later runs", reps + 1,
                            len(batch_sizes) * max_width)
    curve = measure_cost_curve(model, batch_sizes, max_width=max_width, context=128, reps=reps, tick=tick)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve.as_dict()))
    tmp.rename(path)
    return curve
