"""From timed runs to the numbers a report shows: rates, speed-ups against the reference run of
the same job, acceptance, time split, and the speed-up model's prediction beside the measurement."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from speculant.bench.regime import AcceptanceFit
from speculant.bench.runner import Measurement, Runner, add_stats, config_name, stats_from_dict
from speculant.sequence import SpecStats
from speculant.speedup import CostCurve

ALL = "all"


@dataclass
class Row:
    runner: str
    family: str
    method: str | None
    k: int
    batch_size: int
    temperature: float
    prompt_class: str
    jobs: int
    output_tokens: int
    tokens_per_s: float | None
    speedup: float | None  # vs the runner's reference (its family's plain decoding), same jobs
    speedup_iqr: tuple[float, float] | None  # spread of the per-job paired ratios
    vs_speculant: float | None  # rate / Speculant's plain rate (peers)
    identical: float | None  # share of jobs whose output equals the reference's
    ttft_s: float | None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] | None = None
    coverage: float | None = None
    time_split: dict | None = None  # draft / target / other shares of engine time
    fit: dict | None = None
    predicted_speedup: float | None = None
    draft_ms: float | None = None  # engine time proposing, per drafted token
    pass_ratio: float | None = None  # the target's mean pass over the plain run's: C(k+1)/C(1) as run
    # Output tokens over whole requests' time (prefill and first token included): what a machine billed by the
    # hour makes (bench/cost.py). None in reports written before it was recorded.
    e2e_tokens_per_s: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _rate(ms: list[Measurement]) -> float | None:
    tokens, seconds = sum(m.decode_tokens for m in ms), sum(m.decode_s for m in ms)
    return tokens / seconds if seconds > 0 and tokens else None


def _e2e_rate(ms: list[Measurement]) -> float | None:
    tokens, seconds = sum(m.output_tokens for m in ms), sum(m.ttft_s + m.decode_s for m in ms)
    return tokens / seconds if seconds > 0 and tokens else None


def _sum_stats(ms: list[Measurement]) -> dict | None:
    total = SpecStats()
    for m in ms:
        if m.stats:
            add_stats(total, stats_from_dict(m.stats))
    return total.as_dict() if total.target_passes else None


def _pass_means(ms: list[Measurement], narrow: bool) -> float | None:
    """Mean seconds of the steps' one-token target passes (narrow), or of their wider ones (verify passes)."""
    n = s = 0.0
    for m in ms:
        for width, (count, seconds) in (m.passes or {}).items():
            if (int(width) == 1) == narrow:
                n, s = n + count, s + seconds
    return s / n if n else None


def _job_key(m: Measurement) -> tuple:
    return tuple(m.prompt_ids), m.rep, m.batch_size, m.temperature


def summarize(measurements: list[Measurement], runners: list[Runner], curve: CostCurve | None = None,
              by_class: bool = True) -> list[Row]:
    """One row per runner, batch size, temperature and prompt class (plus the class "all")."""
    by_runner = {r.name: r for r in runners}
    groups: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        classes = [ALL] + ([m.prompt_class] if by_class and m.prompt_class != ALL else [])
        for c in classes:
            groups.setdefault((m.runner, m.batch_size, m.temperature, c), []).append(m)
    rows = []
    for (name, b, temp, cls), ms in groups.items():
        runner = by_runner[name]
        ref = {_job_key(m): m for m in groups.get((runner.reference, b, temp, cls), [])}
        plain = groups.get((config_name(None, 0), b, temp, cls), [])
        rows.append(_row(runner, b, temp, cls, ms, ref, plain, curve))
    order = {r.name: i for i, r in enumerate(runners)}
    classes = list(dict.fromkeys([ALL] + [m.prompt_class for m in measurements]))
    rows.sort(key=lambda r: (r.temperature, r.batch_size, classes.index(r.prompt_class), order[r.runner]))
    return rows


def _row(runner: Runner, b: int, temp: float, cls: str, ms: list[Measurement], ref: dict,
         plain: list[Measurement], curve: CostCurve | None) -> Row:
    rate = _rate(ms)
    pairs = [(m, ref[_job_key(m)]) for m in ms if _job_key(m) in ref]
    paired = [r for _, r in pairs]
    ref_rate = _rate(paired)
    ratios = sorted(m.tokens_per_s / r.tokens_per_s for m, r in pairs if m.tokens_per_s and r.tokens_per_s)
    iqr = None
    if len(ratios) >= 4:
        q = statistics.quantiles(ratios, n=4)
        iqr = (q[0], q[2])
    elif ratios:
        iqr = (ratios[0], ratios[-1])
    plain_rate = _rate(plain)
    identical = None
    if runner.name == runner.reference:
        iqr = None
    elif paired:
        identical = sum(m.output_ids == r.output_ids for m, r in pairs) / len(pairs)
    row = Row(runner.name, runner.family, runner.method, runner.k, b, temp, cls, len(ms),
              sum(m.output_tokens for m in ms), rate,
              rate / ref_rate if rate and ref_rate else None, iqr,
              rate / plain_rate if rate and plain_rate and runner.family != "speculant" else None,
              identical, statistics.fmean(m.ttft_s for m in ms))
    row.e2e_tokens_per_s = _e2e_rate(ms)
    if runner.family != "speculant":
        return row
    split = {part: sum(getattr(m, f"{part}_s") or 0 for m in ms) for part in ("draft", "target", "other")}
    total = sum(split.values())
    row.time_split = {p: s / total for p, s in split.items()} if total else None
    stats = _sum_stats(ms)
    if runner.method is None or not stats:
        return row
    row.acceptance_rate = stats["acceptance_rate"]
    row.mean_acceptance_length = stats["mean_acceptance_length"]
    row.per_position_acceptance = stats["per_position_acceptance"]
    row.coverage = stats["num_drafts"] / stats["target_passes"] if stats["target_passes"] else None
    if stats["num_draft_tokens"]:
        row.draft_ms = 1e3 * split["draft"] / stats["num_draft_tokens"]
    one, wide = _pass_means(paired, narrow=True), _pass_means(ms, narrow=False)
    if one and wide:
        row.pass_ratio = wide / one
    base_steps = sum(m.steps or 0 for m in paired)
    if curve is not None and base_steps:
        c1 = sum(m.target_s or 0 for m in paired) / base_steps
        steps = sum(m.steps or 0 for m in ms)
        fit = AcceptanceFit.from_stats(stats, runner.k, split["draft"], steps, c1, runner.extra_nodes)
        row.fit = fit.as_dict()
        row.predicted_speedup = fit.predict(curve, b)
    return row
