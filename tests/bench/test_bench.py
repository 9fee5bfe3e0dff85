"""`speculant bench` and `speculant advise`: the speed-up model against hand-computed values, the
regime verdict, prompt loading, a missing peer, and both commands end to end on tiny models."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from speculant.bench.advise import advise
from speculant.bench.cli import int_list
from speculant.bench.peers import LLAMA_CPP_MISSING, llama_cpp_peers
from speculant.bench.prompts import load_prompts
from speculant.bench.regime import AcceptanceFit, memory_bound_limit, regime_verdict
from speculant.cli import main
from speculant.config import SpeculativeConfig
from speculant.defaults import draft_model_config
from speculant.errors import SpeculantError
from speculant.speedup import CostCurve, expected_tokens_per_pass, fit_alpha, predicted_speedup


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the speed-up model, docs/design.md §3 -------------------------------------------------------------


@pytest.mark.parametrize("alpha, k, expected", [
    (0.5, 3, 1.875),  # (1 - 0.5^4) / 0.5
    (0.8, 4, 3.3616),  # (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2
    (0.0, 6, 1.0),  # nothing accepted: the pass yields its one token
    (1.0, 4, 5.0),  # the α → 1 limit: every draft plus the bonus token
    (1 - 1e-12, 7, 8.0),
])
def test_expected_tokens_per_pass(alpha, k, expected):
    assert expected_tokens_per_pass(alpha, k) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kwargs, expected", [
    # S = E / (C(k+1)/C(1) + k c_draft/C(1)) = 3.3616 / (1.2 + 4 * 0.05) = 3.3616 / 1.4
    (dict(alpha=0.8, k=4, cost_ratio=1.2, draft_cost_ratio=0.05), 2.401142857),
    (dict(alpha=1.0, k=3, cost_ratio=1.0), 4.0),  # free verify, perfect drafts: k + 1
    (dict(alpha=0.5, k=3, cost_ratio=2.5), 0.75),  # compute-bound: 1.875 / 2.5, speculation loses
    (dict(alpha=0.9, k=0, cost_ratio=1.0), 1.0),  # k = 0 is plain decoding
    # Half the steps draft: (0.5 + 0.5 * 3.3616) / (0.5 + 0.5 * 1.2) = 2.1808 / 1.1
    (dict(alpha=0.8, k=4, cost_ratio=1.2, coverage=0.5), 1.982545455),
    # In a batch every pass is widened although half the rows draft: 2.1808 / 1.2
    (dict(alpha=0.8, k=4, cost_ratio=1.2, coverage=0.5, pass_coverage=1.0), 1.817333333),
])
def test_predicted_speedup(kwargs, expected):
    assert predicted_speedup(**kwargs) == pytest.approx(expected, rel=1e-6)


def test_fit_alpha_inverts_expected_tokens():
    assert fit_alpha(1.875, 3) == pytest.approx(0.5, abs=1e-9)
    assert fit_alpha(1.0, 4) == pytest.approx(0.0, abs=1e-9)
    assert fit_alpha(5.0, 4) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError):
        expected_tokens_per_pass(1.5, 2)


def test_acceptance_fit_from_stats():
    # 10 drafting steps of k = 4, 25 accepted: mean acceptance length 3.5; 20 passes, half drafted;
    # 0.4 s of drafting over 20 steps at C(1) = 0.1 s: 0.02 s per pass, per 0.5 * 4 drafted positions.
    stats = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 25, "target_passes": 20}
    fit = AcceptanceFit.from_stats(stats, 4, draft_s=0.4, steps=20, c1_s=0.1)
    assert expected_tokens_per_pass(fit.alpha, 4) == pytest.approx(3.5, rel=1e-6)
    assert fit.coverage == 0.5 and fit.k_mean == 4
    assert fit.draft_cost_ratio == pytest.approx(0.1)
    flat = CostCurve(0, {1: [1.0] * 9})
    assert fit.predict(flat, 1) == pytest.approx(predicted_speedup(fit.alpha, 4, 1.0, 0.1, 0.5))


# -- the cost curve and the regime ---------------------------------------------------------------


def _curve() -> CostCurve:
    """Memory-bound at batch 1 and 4 (verifying is nearly free), compute-bound at 16 (cost ∝ T)."""
    return CostCurve(128, {1: [1.0 + 0.02 * t for t in range(9)],
                           4: [2.0 + 0.1 * t for t in range(9)],
                           16: [4.0 * (t + 1) for t in range(9)]})


def test_cost_curve_ratio_and_verdict():
    curve = _curve()
    assert curve.ratio(4, 5) == pytest.approx(2.4 / 2.0)
    assert curve.ratio(4, 2.5) == pytest.approx(2.15 / 2.0)  # linear between measured widths
    assert curve.ratio(2, 5) == pytest.approx(curve.ratio(1, 5))  # nearest measured batch (log scale)
    assert curve.free_width(1) == 9 and curve.free_width(4) == 7 and curve.free_width(16) == 1
    assert memory_bound_limit(curve) == 4
    verdict = regime_verdict(curve)
    assert verdict.startswith("memory-bound up to batch 4") and "B=16: 5.00" in verdict
    assert regime_verdict(CostCurve(0, {1: [1.0, 3.0, 5.0, 7.0, 9.0]})).startswith("compute-bound already")


def test_advise_switches_speculation_off_where_it_loses():
    fit = AcceptanceFit(alpha=0.7, coverage=1.0, k_mean=4.0, k=4, draft_cost_ratio=0.0)
    advice = advise(_curve(), {"ngram": fit}, [1, 4, 16])
    assert [a.batch_size for a in advice] == [1, 4, 16]
    assert advice[0].method == "ngram" and advice[0].k >= 4 and advice[0].speedup > 2
    assert 0 < advice[1].k <= advice[0].k  # verify costs more at batch 4: shorter drafts
    assert advice[2].method is None and advice[2].k == 0 and advice[2].speedup == 1.0


def test_an_assumed_draft_acceptance_predicts_from_the_measured_costs():
    import argparse

    from speculant.bench.advise import acceptance_arg, assume_draft_acceptance

    # A random-weight stand-in: its draft is never accepted, so measured, no speculation pays.
    draft = AcceptanceFit(alpha=0.01, coverage=0.94, k_mean=4.0, k=4, draft_cost_ratio=0.05)
    ngram = AcceptanceFit(alpha=0.02, coverage=0.3, k_mean=4.0, k=4, draft_cost_ratio=0.0)
    measured = {"draft_model+vocab65536": draft, "ngram": ngram}
    assert all(a.method is None for a in advise(_curve(), measured, [1, 4]))
    assumed = assume_draft_acceptance(measured, 0.8)
    assert assumed["ngram"] is ngram  # prompt lookup's acceptance is the text's, not the pair's
    d = assumed["draft_model+vocab65536"]
    assert (d.alpha, d.coverage, d.draft_cost_ratio) == (0.8, 0.94, 0.05)
    best = advise(_curve(), assumed, [1])[0]
    assert best.method == "draft_model+vocab65536" and best.speedup > 1.5
    # The MTP layer's gain from a published acceptance: a drafted token costs a few percent of a pass.
    mtp = AcceptanceFit(alpha=0.0, coverage=0.9, k_mean=4.0, k=4, draft_cost_ratio=0.04)
    assumed = assume_draft_acceptance({"mtp": mtp, "draft_model": draft}, 0.73, "mtp")
    assert assumed["draft_model"] is draft and assumed["mtp"].alpha == 0.73
    best = advise(_curve(), assumed, [1])[0]
    assert best.method == "mtp" and best.speedup > 1.5
    assert acceptance_arg("0.7") == 0.7
    for bad in ("1", "-0.1", "high"):
        with pytest.raises(argparse.ArgumentTypeError):
            acceptance_arg(bad)


# -- prompts -----------------------------------------------------------------------------------


def test_prompts_without_tokenizer_and_user_jsonl(tmp_path):
    prompts = load_prompts(["code", "chat", "rewrite"], None, vocab_size=96, per_class=2)
    assert [p.prompt_class for p in prompts] == ["code", "chat", "rewrite"] * 2
    assert all(0 <= t < 96 for p in prompts for t in p.token_ids)
    assert prompts[0].token_ids == [b % 96 for b in prompts[0].text.encode()]
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt_token_ids": [5, 6, 7]}\n\n{"prompt": "hello", "class": "greet", "id": "h"}\n')
    got = load_prompts([str(mine)], None, vocab_size=96)
    assert [(p.prompt_class, p.id, p.token_ids) for p in got] == [
        ("mine", "mine-0", [5, 6, 7]), ("greet", "h", [b % 96 for b in b"hello"])]
    mine.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(SpeculantError, match="mine.jsonl:1"):
        load_prompts([str(mine)], None, vocab_size=96)
    with pytest.raises(SpeculantError, match="neither a shipped class"):
        load_prompts(["poetry"], None, vocab_size=96)


def test_int_list():
    assert int_list("1..4") == [1, 2, 3, 4]
    assert int_list("2,4,8") == [2, 4, 8]


# -- peers ---------------------------------------------------------------------------------------


def test_missing_llama_cpp_is_skipped_with_its_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    runners, notes = llama_cpp_peers(tmp_path / "model.gguf", [4], [2], 256)
    assert runners == [] and notes == [LLAMA_CPP_MISSING]


# -- end to end ----------------------------------------------------------------------------------


def test_bench_quick_end_to_end(tiny_pair, tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    target, draft = tiny_pair
    out = tmp_path / "report"
    rc = main(["bench", "--model", str(target), "--draft-model", str(draft), "--quick", "--per-class", "1",
               "--proposers", "ngram,draft_model,draft_model+lookup", "--max-tokens", "12", "--price-per-hour", "2.5",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    written = {p.name for p in out.iterdir()}
    assert written == {"report.md", "report.json", "speedup_vs_batch.png", "speedup_vs_k.png",
                       "per_position_acceptance.png", "cost_curve.png"}
    assert all((out / name).stat().st_size > 0 for name in written)
    printed = capsys.readouterr().out
    assert LLAMA_CPP_MISSING in printed and "regime:" in printed
    assert "cost per million generated tokens at $2.5/hour, batch 1, greedy, whole requests: plain $" in printed

    report = json.loads((out / "report.json").read_text())
    assert set(report["experiments"]) == {"k", "batch", "temperature"}
    assert report["cost_curve"]["seconds"].keys() == {"1", "4", "16"}
    assert LLAMA_CPP_MISSING in report["notes"]
    k_rows = report["experiments"]["k"]["summary"]
    names = {r["runner"] for r in k_rows}
    assert {"speculant k=0", "speculant ngram k=2", "speculant ngram k=4", "speculant draft_model k=4",
            "speculant draft_model+lookup k=4", "transformers plain", "transformers prompt_lookup k=4",
            "transformers assistant k=4"} <= names
    # Greedy speculation is lossless: every configuration wrote the plain output, token for token.
    assert all(r["identical"] == 1.0 for r in k_rows if r["family"] == "speculant" and r["method"])
    # Seeded sampling with lookup's drafts writes plain decoding's tokens too.
    lookup = [r for r in report["experiments"]["temperature"]["summary"]
              if r["temperature"] > 0 and r["runner"].startswith("speculant ngram")]
    assert lookup and all(r["identical"] == 1.0 for r in lookup)
    spec = [r for r in k_rows if r["method"] and r["family"] == "speculant" and r["prompt_class"] == "all"]
    assert all(r["speedup"] and r["predicted_speedup"] for r in spec)
    # Every row that drafted reports its acceptance. Adaptive k alone may draft nothing: this random draft
    # never pays, and once its cost is measured it is left off.
    assert all(r["acceptance_rate"] is not None for r in spec if r["coverage"])
    assert all("adaptive" in r["method"] and r["predicted_speedup"] == 1.0 for r in spec if not r["coverage"])
    batch_sizes = {r["batch_size"] for r in report["experiments"]["batch"]["summary"] if r["method"]}
    assert batch_sizes == {1, 4}
    assert {r["batch_size"] for r in report["cost"]} == {1, 4}

    md = (out / "report.md").read_text()
    for heading in ("## Headline", "## Regime", "## Speed-up vs k", "## Speed-up vs batch size",
                    "## Sampling", "## Peers", "## Cost per million generated tokens at $2.5/hour"):
        assert heading in md
    assert "![speed-up vs batch size](speedup_vs_batch.png)" in md

    # The report renders again from its JSON alone, at another price, measuring nothing.
    again = tmp_path / "again"
    rc = main(["bench", "--render", str(out / "report.json"), "--price-per-hour", "4", "--out", str(again)])
    assert rc == 0
    assert "## Cost per million generated tokens at $4/hour" in (again / "report.md").read_text()
    assert {p.name for p in again.iterdir()} == written - {"report.json"}


def test_advise_end_to_end(tiny_pair, tmp_path, capsys, one_thread):
    target, draft = tiny_pair
    details = tmp_path / "advice.json"
    rc = main(["advise", str(target), "--draft", str(draft), "--batch-sizes", "1,2", "--max-tokens", "12",
               "--json", str(details), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "regime:" in printed and "expected speed-up" in printed
    assert "cost per million generated tokens at $0.1/hour, batch 1, measured" in printed
    assert "$/M tokens, plain" in printed and "$/M tokens, advised" in printed
    assert "--speculative-config '{" in printed or "no speculation at batch 1" in printed
    advice = json.loads(details.read_text())["advice"]
    assert [a["batch_size"] for a in advice] == [1, 2]
    # The draft as `--draft-model` alone drafts it: a chain with the default rules.
    drafted = SpeculativeConfig.parse(draft_model_config(str(draft))).proposer
    assert drafted == "draft_model+lookup+vocab65536+pchain0.7"
    assert set(json.loads(details.read_text())["fits"]) == {"ngram", drafted}


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 2, "corpus": "table.safetensors"},
    {"method": "draft_model", "num_speculative_tokens": 3, "model": "draft", "lookup_first": True},
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "draft", "lookup_first": True,
     "draft_vocab_size": 65536, "draft_p_min": 0.6},
])
def test_advise_prints_a_config_the_cli_takes_as_it_is(config):
    """advise names proposers as reports do (ngram+corpus, draft_model+lookup); its flag must be a config
    that --speculative-config parses back to the measured proposer at the advised k."""
    from speculant.bench.advise import Advice, speculative_config_line
    from speculant.config import SpeculativeConfig

    measured = SpeculativeConfig.parse(config)
    line = speculative_config_line(Advice(1, measured.proposer, 5, 1.3), {measured.proposer: measured})
    flag = json.loads(line.removeprefix("--speculative-config '").removesuffix("'"))
    parsed = SpeculativeConfig.parse(flag)
    assert parsed.proposer == measured.proposer and parsed.num_speculative_tokens == 5
    assert parsed == SpeculativeConfig.parse({**config, "num_speculative_tokens": 5})


def test_a_failing_peer_is_left_out_with_a_line_and_ours_are_not():
    """Another library's bug in a peer ends neither the warm-up nor the sweep: the peer is dropped with one note
    and its measurements with it; an error in one of our own configurations still ends the run."""
    from speculant.bench.runner import Job, Measurement, Runner, run_jobs, warm_up
    from speculant.config import SamplingParams

    class Fake(Runner):
        def __init__(self, name, family, fail_after):
            super().__init__(name, family, None, 0, name)
            self.fail_after, self.calls = fail_after, 0

        def run(self, prompts, params):
            self.calls += 1
            if self.calls > self.fail_after:
                raise ValueError("the peer's own bug")
            return Measurement(self.name, [], "", 1, 0.0, 0, [[1]], ttft_s=0.1, decode_s=0.1, decode_tokens=1)

        def forget(self):
            pass

    jobs = [Job(["p"], "code", [[1, 2]], [SamplingParams(max_tokens=4)]) for _ in range(3)]
    ours, peer = Fake("plain", "speculant", 99), Fake("transformers plain", "transformers", 2)
    runners, notes = [ours, peer], []
    warm_up(runners, jobs[0], notes)
    measured = run_jobs(runners, jobs, notes=notes)
    assert runners == [ours] and {m.runner for m in measured} == {"plain"} and len(measured) == 3
    assert notes == ["transformers plain left out: it failed (ValueError: the peer's own bug)"]
    with pytest.raises(ValueError):
        run_jobs([Fake("plain", "speculant", 0)], jobs, notes=[])
