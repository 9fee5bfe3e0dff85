"""Cost per million generated tokens: the arithmetic, the --price-per-hour flag, the bench's and advise's tables."""

from __future__ import annotations

import argparse

import pytest

from speculant.bench.advise import Advice, _advice_table, advice_costs
from speculant.bench.cli import price_from_args
from speculant.bench.cost import DEFAULT_PRICE_PER_HOUR, cost_line, saving, usd_per_million
from speculant.bench.report import cost_section, headline_cost
from speculant.bench.runner import Runner
from speculant.bench.suite import BenchPlan, BenchResult, Experiment, cost_table
from speculant.bench.summary import ALL, Row
from speculant.cli import build_parser
from speculant.errors import SpeculantError
from speculant.speedup import CostCurve


def test_a_million_tokens_cost_the_hours_they_take():
    # 100 tokens/s: a million in 10,000 s = 2.78 hours; at $0.36/hour, $1.00.
    assert usd_per_million(100, 0.36) == pytest.approx(1.0)
    assert usd_per_million(1e6 / 3600, 1.0) == pytest.approx(1.0)  # a million an hour costs the hour
    assert usd_per_million(200, 0.36) == pytest.approx(0.5)  # twice the rate, half the cost
    with pytest.raises(ValueError):
        usd_per_million(0, 1.0)


def test_the_saving_is_one_less_the_inverse_speed_up():
    plain, spec = usd_per_million(100, 0.1), usd_per_million(185, 0.1)
    assert saving(plain, spec) == pytest.approx(1 - 1 / 1.85)
    assert saving(1.0, 1.25) == pytest.approx(-0.25)  # slower costs more


def test_cost_line_puts_plain_and_speculating_side_by_side():
    line = cost_line(0.36, 100, [("ngram k=4", 125)], "batch 1")
    assert line == "cost per million generated tokens at $0.36/hour, batch 1: plain $1.000, ngram k=4 $0.800 (-20%)"


def test_price_flag_defaults_to_a_small_cloud_vm_and_refuses_nonsense():
    assert 0.01 < DEFAULT_PRICE_PER_HOUR < 1
    args = build_parser().parse_args(["bench"])
    assert price_from_args(args) == DEFAULT_PRICE_PER_HOUR
    assert price_from_args(build_parser().parse_args(["advise", "--price-per-hour", "2.5"])) == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SpeculantError, match="--price-per-hour must be a positive number"):
            price_from_args(argparse.Namespace(price_per_hour=float(bad)))


def row(runner: str, method: str | None, k: int, b: int, tps: float, e2e: float | None, speedup=None) -> Row:
    return Row(runner, "speculant", method, k, b, 0.0, ALL, 1, 100, tps, speedup, None, None, None, 0.1,
               e2e_tokens_per_s=e2e)


def result(rows: list[Row], price: float | None) -> BenchResult:
    runners = [Runner(r.runner, "speculant", r.method, r.k, "speculant k=0") for r in rows]
    experiments = {name: Experiment(name, "", runners, rows=rows) for name in ("k", "batch")}
    return BenchResult(BenchPlan(price_per_hour=price), {}, CostCurve(16, {1: [0.01, 0.011]}), experiments, [])


def test_bench_costs_whole_requests_and_falls_back_to_decode_rates_in_old_reports():
    rows = [row("speculant k=0", None, 0, 1, 120, 100), row("speculant ngram k=4", "ngram", 4, 1, 180, 150, 1.5)]
    table = cost_table(result(rows, 0.36))
    assert [(t["runner"], t["rate"], round(t["usd_per_million_tokens"], 4)) for t in table] == [
        ("speculant k=0", "end to end", 1.0), ("speculant ngram k=4", "end to end", 0.6667)]
    section = "\n".join(cost_section(result(rows, 0.36)))
    assert "## Cost per million generated tokens at $0.36/hour" in section
    assert "| 1 | speculant ngram k=4 | $1.000 | $0.667 | 33% |" in section
    old = [row("speculant k=0", None, 0, 1, 120, None), row("speculant ngram k=4", "ngram", 4, 1, 180, None, 1.5)]
    assert {t["rate"] for t in cost_table(result(old, 0.36))} == {"decode"}
    assert "predates whole-request rates" in "\n".join(cost_section(result(old, 0.36)))
    assert cost_table(result(rows, None)) == [] and headline_cost(result(rows, None)) is None


def test_bench_headline_costs_each_proposer_at_its_best_k():
    rows = [row("speculant k=0", None, 0, 1, 120, 100), row("speculant ngram k=2", "ngram", 2, 1, 150, 125, 1.25),
            row("speculant ngram k=4", "ngram", 4, 1, 180, 150, 1.5)]
    assert headline_cost(result(rows, 0.36)) == ("cost per million generated tokens at $0.36/hour, batch 1, greedy, "
                                                 "whole requests: plain $1.000, ngram k=4 $0.667 (-33%)")


def test_advise_costs_each_batch_size_from_the_cost_curve():
    curve = CostCurve(128, {1: [0.01, 0.011], 4: [0.02, 0.03]})
    advice = [Advice(1, "ngram", 4, 2.0), Advice(4, None, 0, 1.0)]
    costs = advice_costs(advice, curve, 0.36)
    # batch 1: 100 tokens/s plain → $1.00, twice as fast speculating; batch 4: 200 tokens/s → $0.50, not drafted.
    assert costs == [pytest.approx({"batch_size": 1, "plain": 1.0, "advised": 0.5}),
                     pytest.approx({"batch_size": 4, "plain": 0.5, "advised": 0.5})]
    table = _advice_table(advice, curve, 0.36)
    assert "$/M tokens, plain" in table and "$/M tokens, advised" in table and "0.500" in table
