"""Side-by-side comparison of the shipped drafts on held-out prompts.

`python -m speculant.training.evaluate`: batch 1, greedy and temperature 0.7, k in {2, 4, 6}, for
ngram, eagle and draft_model, against plain decoding (k = 0) on the same engine code. The runs
are interleaved (every configuration runs on one prompt before the next prompt starts) so a
busy machine slows them all alike. The prompts below were written for this evaluation: they
are not in the training pools (the standard library and installed packages' descriptions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculant.arguments import add_target_arguments
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.defaults import SHIPPED, default_speculative_config
from speculant.engine import Engine
from speculant.llm import engine_for
from speculant.models.loader import LoadedModel, load_model

HELD_OUT = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number using a loop.",
        "Write a Python class `Stack` with push, pop and peek methods, and a short usage example.",
    ],
    "chat": [
        "What are three good habits for staying healthy while working at a desk all day?",
        "Explain to a ten-year-old why the sky is blue.",
    ],
    "rewrite": [
        "Rewrite this sentence so it sounds more polite: 'Send me the report now, you are late again.'",
        "Rewrite this paragraph in simpler words: 'The municipality has resolved to postpone the "
        "inauguration of the refurbished library owing to unforeseen budgetary constraints.'",
    ],
}


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0  # whole requests: prefill + decode
    decode_seconds: float = 0.0  # from the first generated token to the last
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def row(self, baseline: Result) -> dict:
        # Same prompts, same token counts (greedy) or nearly (sampled): compare rates.
        tps = self.tokens / self.seconds
        decode_tps = self.tokens / self.decode_seconds
        return {"tokens": self.tokens, "tokens_per_s": round(tps, 2),
                "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
                "mean_acceptance_length": round(1 + self.accepted / self.drafts, 2) if self.drafts else None,
                "speedup": round(tps / (baseline.tokens / baseline.seconds), 2),
                "decode_speedup": round(decode_tps / (baseline.tokens / baseline.decode_seconds), 2)}


Case = tuple[str, int, dict | None]


def configs(eagle: Path, draft: Path | None, ks: list[int], default: dict | None = None) -> list[Case]:
    """(proposer, k, speculative config) of every run; `default` adds what `generate` uses by default;
    no draft: no draft_model runs."""
    out: list[Case] = [("baseline", 0, None)]
    if default is not None:
        out.append(("default: " + default["method"] + (" adaptive" if default.get("adaptive") else ""),
                    default["num_speculative_tokens"], default))
    for k in ks:
        out.append(("ngram", k, {"method": "ngram", "num_speculative_tokens": k}))
        out.append(("eagle", k, {"method": "eagle", "model": str(eagle), "num_speculative_tokens": k}))
        if draft is not None:
            out.append(("draft_model", k,
                        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}))
    return out


def make_engine(target: LoadedModel, spec: dict | None, max_len: int) -> Engine:
    return engine_for(target, SpeculativeConfig.parse(spec), 1, max_len)


def run(target: LoadedModel, eagle: Path, draft: Path | None, ks: list[int], max_tokens: int,
        temperatures: list[float], max_len: int = 1024, out: Path | None = None,
        default: dict | None = None) -> dict:
    """Every configuration on every prompt; the report so far is written to `out` after each prompt."""
    cases = configs(eagle, draft, ks, default)
    engines = {(name, k): make_engine(target, spec, max_len) for name, k, spec in cases}
    results = {(name, k, t): Result() for name, k, _ in cases for t in temperatures}
    # Kinds take turns, so a run stopped early still covers all three.
    prompts = [(kind, ps[j]) for j in range(max(map(len, HELD_OUT.values())))
               for kind, ps in HELD_OUT.items() if j < len(ps)]
    for i, (kind, prompt) in enumerate(prompts):
        ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        for t in temperatures:
            for name, k, _ in cases:
                engine = engines[(name, k)]
                s = engine.stats
                before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts)
                params = SamplingParams(temperature=t, seed=1000 + i, max_tokens=max_tokens)
                t0 = time.perf_counter()
                seq = engine.generate([engine.add_request(ids, params)])[0]
                r = results[(name, k, t)]
                r.seconds += time.perf_counter() - t0
                r.decode_seconds += seq.finish_time - seq.first_token_time
                r.tokens += seq.num_generated
                r.drafted += engine.stats.num_draft_tokens - before[0]
                r.accepted += engine.stats.num_accepted_tokens - before[1]
                r.drafts += engine.stats.num_drafts - before[2]
                r.outputs.append(seq.output_ids)
            print(f"prompt {i + 1}/{len(prompts)} ({kind}) t={t} done", flush=True)
        if out is not None:
            out.write_text(json.dumps(report(results, cases, temperatures, i + 1, max_tokens), indent=2))
    return report(results, cases, temperatures, len(prompts), max_tokens)


def report(results: dict, cases: list, temperatures: list[float], n_prompts: int, max_tokens: int) -> dict:
    table = []
    for t in temperatures:
        base = results[("baseline", 0, t)]
        for name, k, _ in cases:
            r = results[(name, k, t)]
            row = {"proposer": name, "k": k, "temperature": t, **r.row(base)}
            if t == 0 and name != "baseline":
                row["greedy_output_identical"] = r.outputs == base.outputs
            table.append(row)
    return {"prompts_done": n_prompts, "prompts": {k: len(v) for k, v in HELD_OUT.items()},
            "max_tokens": max_tokens, "threads": torch.get_num_threads(), "rows": table}


def markdown(report: dict) -> str:
    lines = ["| temperature | proposer | k | acceptance rate | mean acceptance length | tokens/s "
             "| speed-up (end to end) | speed-up (decode) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        acc = "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "—" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(f"| {r['temperature']} | {r['proposer']} | {r['k']} | {acc} | {mal} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['decode_speedup']:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(p)
    p.add_argument("--eagle", type=Path, default=SHIPPED / "eagle")
    p.add_argument("--draft-model", type=Path, default=SHIPPED / "draft_model")
    p.add_argument("--ks", default="2,4,6")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--no-default", action="store_true",
                   help="leave out the configuration `speculant generate` uses by default")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = args.draft_model if (args.draft_model / "model.safetensors").is_file() else None
    if draft is None:
        from speculant.bench.suite import missing_draft

        print(f"draft_model left out: {missing_draft('draft_model')}", file=sys.stderr)
    target = load_model(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    result = run(target, args.eagle, draft, [int(k) for k in args.ks.split(",")],
                 args.max_tokens, [float(t) for t in args.temperatures.split(",")], out=args.out,
                 default=None if args.no_default else default_speculative_config(args.model))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
