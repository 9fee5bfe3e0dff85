"""`speculant advise [MODEL] [--draft PATH]`: a short run that says whether speculation pays here.

It measures the target's cost curve at several batch sizes and each available proposer's acceptance
on a few prompts at batch 1, fits the speed-up model of docs/design.md §3 to them, and prints the regime,
the best k per batch size (0 where speculation would lose) and a ready --speculative-config line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from speculant.arguments import DEVICE_HELP, DTYPE_HELP, whole_number
from speculant.bench.cli import int_list, price_from_args
from speculant.bench.cost import PRICE_HELP, cost_line, usd_per_million
from speculant.bench.prompts import PROMPT_CLASSES, load_prompts
from speculant.bench.regime import AcceptanceFit, regime_verdict
from speculant.bench.runner import engine_runner, run_jobs, warm_up
from speculant.bench.suite import (
    DEFAULT_PROPOSERS,
    BenchPlan,
    Progress,
    machine_facts,
    make_jobs,
    proposer_configs,
    try_runner,
)
from speculant.bench.summary import ALL, summarize
from speculant.config import SpeculativeConfig
from speculant.defaults import draft_model_config
from speculant.errors import SpeculantError
from speculant.models.loader import load_model, resolve_model_path
from speculant.models.quantize import QUANTIZATIONS
from speculant.speedup import CostCurve, measure_cost_curve

PROBE_K = 4  # the k acceptance is measured at; the model extrapolates to 1..MAX_K
MAX_K = 8


@dataclass
class Advice:
    batch_size: int
    method: str | None  # None: do not speculate
    k: int
    speedup: float  # predicted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("A short run (about 2 minutes on 2 CPU cores for the bundled model): is this setup "
                     "memory-bound, which num_speculative_tokens to use per batch size, and what speed-up "
                     "to expect.")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file or a name from `speculant models` (default: the bundled "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None,
                   help="a draft model path or name: also consider method draft_model")
    p.add_argument("--eagle", default=None, help="an EAGLE head path: also consider method eagle")
    p.add_argument("--mtp", default=None, metavar="FILE",
                   help="an MTP-only GGUF beside the target (convert_hf_to_gguf --mtp): also consider method mtp; "
                        "a target that carries its MTP layer (Qwen3.5, Qwen3-Next) is considered without it")
    p.add_argument("--mtp-acceptance", type=acceptance_arg, default=None, metavar="ALPHA",
                   help="as --draft-acceptance, for the MTP layer (published: ~0.73 on Qwen3.6-27B at k 3)")
    p.add_argument("--draft-acceptance", type=acceptance_arg, default=None, metavar="ALPHA",
                   help="predict the draft model's gain with this per-token acceptance (0 ≤ ALPHA < 1) "
                        "instead of the one measured here; its cost and the target's cost curve are still "
                        "measured. For a target whose weights cannot show it (a random-weight stand-in of "
                        "the real shape) or a pair whose acceptance you measured elsewhere")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--quantization", "-q", default="auto", choices=list(QUANTIZATIONS),
                   help="as for generate (default auto: a GGUF file at the precision it stores)")
    p.add_argument("--threads", type=whole_number(1), default=None,
                   help="PyTorch CPU threads (default: PyTorch's choice; 1 suits a machine shared with "
                        "other work)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes to advise for (default 1,2,4,8,16,32)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="the batch size you serve at, for the --speculative-config line (default 1)")
    p.add_argument("--prompts", nargs="+", default=list(PROMPT_CLASSES),
                   help="shipped classes and/or JSONL files, as for `speculant bench` (default: three of each "
                        "class)")
    # Shorter runs measure too few steps: their speed-up strays from the model's by more than the 15% it
    # is meant to be good to.
    p.add_argument("--per-class", type=int, default=3, help="prompts per class (default 3)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per prompt (default 96)")
    p.add_argument("--price-per-hour", type=float, default=None, help=PRICE_HELP)
    p.add_argument("--json", default=None, help="also write the measurements and advice to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def acceptance_arg(text: str) -> float:
    try:
        alpha = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= alpha < 1:
        raise argparse.ArgumentTypeError(f"a per-token acceptance is at least 0 and below 1, got {alpha:g}")
    return alpha


def assume_draft_acceptance(fits: dict[str, AcceptanceFit], alpha: float,
                            method: str = "draft_model") -> dict[str, AcceptanceFit]:
    """The fits of `method` (draft models, or the MTP layer) with their acceptance replaced; their measured cost
    per drafted token and coverage kept. Other proposers' acceptance depends on the text, not on a pair: left as
    measured."""
    return {m: replace(f, alpha=alpha) if m.startswith(method) else f for m, f in fits.items()}


def advised_proposers(draft: str | None, mtp: bool = False) -> list[str]:
    """The bench's default proposers, the draft model named as reports name it with the drafting rules
    `--draft-model` applies (draft_model+lookup+vocab65536+…); the MTP layer where the target has one."""
    name = SpeculativeConfig.parse(draft_model_config(draft)).proposer if draft else "draft_model"
    return [name if p == "draft_model" else p for p in DEFAULT_PROPOSERS] + ["mtp"] * mtp


def advise(curve: CostCurve, fits: dict[str, AcceptanceFit], batch_sizes: list[int]) -> list[Advice]:
    """Per batch size, the proposer and k with the best predicted speed-up, or no speculation."""
    out = []
    for b in batch_sizes:
        best = Advice(b, None, 0, 1.0)
        for method, fit in fits.items():
            k, s = fit.best_k(curve, b, MAX_K)
            if k and s > best.speedup:
                best = Advice(b, method, k, s)
        out.append(best)
    return out


def speculative_config_line(advice: Advice, configs: dict[str, SpeculativeConfig]) -> str:
    """The flag `generate` and `serve` take as it is: the measured configuration (by its report name,
    e.g. ngram+corpus) at the advised k, its fields that differ from the defaults."""
    if advice.method is None:
        return f"no speculation at batch {advice.batch_size}: leave --speculative-config out"
    chosen = replace(configs[advice.method], num_speculative_tokens=advice.k)
    defaults = SpeculativeConfig(chosen.method, chosen.num_speculative_tokens)
    config = {name: value for name, value in asdict(chosen).items()
              if name in ("method", "num_speculative_tokens") or value != getattr(defaults, name)}
    return f"--speculative-config '{json.dumps(config)}'"


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    price = price_from_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = Progress(not args.no_progress)
    model_path = resolve_model_path(args.model)
    target = load_model(model_path, dtype=args.dtype, device=args.device, quantization=args.quantization)
    plan = BenchPlan(model=args.model, dtype=args.dtype, device=args.device, quantization=target.quantization,
                     adaptive=False, draft_model=args.draft, eagle=args.eagle, mtp=args.mtp,
                     proposers=advised_proposers(args.draft, bool(args.mtp or target.config.mtp_layers)))
    prompts = load_prompts(args.prompts, target.tokenizer, target.config.vocab_size,
                           per_class=args.per_class, max_prompt_tokens=plan.max_prompt_tokens)
    if not prompts:
        raise SpeculantError("no prompts to run")
    max_len = max(len(p.token_ids) for p in prompts) + args.max_tokens + 1

    sizes = sorted(set(args.batch_sizes) | {1})
    tick = progress.phase("cost curve", len(sizes) * 3 * (MAX_K + 1))
    curve = measure_cost_curve(target.model, sizes, MAX_K + 1, min(256, max_len), reps=2, tick=lambda: tick())

    notes: list[str] = []
    configs, skipped = proposer_configs(plan, PROBE_K)
    notes += skipped
    runners = [engine_runner(target, None, 1, max_len)]
    runners += [r for spec in configs if (r := try_runner(target, spec, 1, max_len, notes))]
    jobs = make_jobs(prompts, 1, 0.0, args.max_tokens, 1, 0)
    warm_up(runners, jobs[0])
    measurements = run_jobs(runners, jobs, progress.phase("acceptance", len(jobs) * len(runners)))
    summary = summarize(measurements, [r.descriptor() for r in runners], curve, by_class=False)
    rows = [r for r in summary if r.prompt_class == ALL and r.method and r.fit]
    plain = next(r for r in summary if r.prompt_class == ALL and r.method is None)
    measured_fits = {r.method: AcceptanceFit(**r.fit) for r in rows}
    fits = measured_fits
    for method, alpha, flag in (("draft_model", args.draft_acceptance, "--draft-acceptance"),
                                ("mtp", args.mtp_acceptance, "--mtp-acceptance")):
        if alpha is None:
            continue
        assumed = assume_draft_acceptance(fits, alpha, method)
        notes += [f"{m}: predicted with the acceptance α={assumed[m].alpha:.2f} given by {flag} "
                  f"(measured here: {f.alpha:.2f}); its cost as measured" for m, f in measured_fits.items()
                  if assumed[m] is not fits[m]]
        fits = assumed
    advice = advise(curve, fits, args.batch_sizes)
    by_name = {c.proposer: c for c in configs}

    facts = machine_facts()
    lines = advice_lines(f"{model_path.name} on {facts['cpu']} ({facts['cpu_count']} cores, {facts['torch_threads']} "
                         f"thread{'s' if facts['torch_threads'] != 1 else ''}), {args.device}, "
                         f"{str(target.model.dtype).removeprefix('torch.')}, weights {target.quantization or 'none'}: "
                         f"measured in {time.perf_counter() - started:.0f} s",
                         curve, rows, measured_fits, plain, price, notes, advice, by_name, args.batch_size)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": facts, "model": str(model_path), "cost_curve": curve.as_dict(),
            "regime": regime_verdict(curve), "fits": {m: f.as_dict() for m, f in fits.items()},
            "measured_fits": {m: f.as_dict() for m, f in measured_fits.items()},
            "measured": [r.as_dict() for r in [plain, *rows]], "advice": [a.__dict__ for a in advice],
            "price_per_hour": price, "cost": advice_costs(advice, curve, price), "notes": notes,
        }, indent=1) + "\n")
        print(f"details: {args.json}", file=sys.stderr)


def advice_lines(header: str, curve: CostCurve, rows: list, fits: dict[str, AcceptanceFit], plain, price: float,
                 notes: list[str], advice: list[Advice], by_name: dict, batch_size: int) -> list[str]:
    """What advise prints: the machine and run, the regime, each proposer's measured and modelled gain, the
    cost per token, the advice per batch size and the config line for the batch size served."""
    lines = [header, f"regime: {regime_verdict(curve)}"]
    for r in rows:
        fit = fits[r.method]
        lines.append(f"{r.method}: at batch 1, k={r.k}: measured {r.speedup or 0:.2f}×, model "
                     f"{r.predicted_speedup or 0:.2f}×; per-token acceptance α={fit.alpha:.2f}, drafts on "
                     f"{100 * fit.coverage:.0f}% of steps"
                     + (f", a drafted token costs {100 * fit.draft_cost_ratio:.1f}% of a target pass"
                        if fit.draft_cost_ratio else ""))
    measured = [(f"{r.method} k={r.k}", r.e2e_tokens_per_s) for r in rows if r.e2e_tokens_per_s]
    if plain.e2e_tokens_per_s:
        lines.append(cost_line(price, plain.e2e_tokens_per_s, measured, "batch 1, measured, whole requests"))
    lines += notes
    lines.append(_advice_table(advice, curve, price))
    serve = min(advice, key=lambda a: abs(a.batch_size - batch_size))
    lines.append(f"at batch {serve.batch_size}: {speculative_config_line(serve, by_name)}")
    return lines


def advice_costs(advice: list[Advice], curve: CostCurve, price: float) -> list[dict]:
    """Per advised batch size, dollars per million generated tokens, plain and as advised, from the cost curve:
    B tokens a one-token pass of B rows, B × (the advised speed-up) with speculation. The passes alone: the
    engine's own work per step is left out (the measured line above has it)."""
    out = []
    for a in advice:
        plain = usd_per_million(a.batch_size / curve.cost(a.batch_size, 1), price)
        out.append({"batch_size": a.batch_size, "plain": plain, "advised": plain / a.speedup})
    return out


def _advice_table(advice: list[Advice], curve: CostCurve, price: float) -> str:
    costs = advice_costs(advice, curve, price)
    cells = [("batch size", [str(a.batch_size) for a in advice]),
             ("method", [a.method or "–" for a in advice]),
             ("k", [str(a.k) for a in advice]),
             ("expected speed-up", [f"{a.speedup:.2f}×" for a in advice]),
             ("$/M tokens, plain", [f"{c['plain']:.3f}" for c in costs]),
             ("$/M tokens, advised", [f"{c['advised']:.3f}" for c in costs])]
    width = max(len(c) for _, row in cells for c in row) + 2
    return "\n".join(f"{label:<20}" + "".join(c.rjust(width) for c in row) for label, row in cells) + (
        f"\n(dollars per million generated tokens at ${price:g}/hour from the cost curve: target passes alone)")
