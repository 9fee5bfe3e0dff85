"""The `speculant` command: generate | serve | bench | advise | train-draft | models."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from dataclasses import asdict

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.errors import SpeculantError
from speculant.models import notice
from speculant.models.loader import CUDA_GRAPHS_ENV
from speculant.models.quantize import QUANTIZATIONS
from speculant.scheduler import DEFAULT_PREFILL_CHUNK

# Subcommands that live with their feature: module path → it defines add_arguments(p) and run(args).
FEATURE_COMMANDS = {
    "serve": ("speculant.server.cli", "OpenAI-compatible HTTP server with speculative decoding"),
    "bench": ("speculant.bench.cli", "side-by-side benchmark: speed-up per k, batch size, proposer"),
    "advise": ("speculant.bench.advise", "short run that says whether speculation pays on this setup"),
    "train-draft": ("speculant.training.cli", "train an EAGLE-style head or a distilled draft model"),
    "models": ("speculant.models.registry", "list the named models --model NAME accepts (fetched with pip on "
                                            "first use), installed or not"),
}
QUIET_HELP = ("no line about first-run waits (a kernel build, a GGUF repack, a cost curve's measurement); "
              "errors and the run's statistics still print")


def add_target_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The target model's flags, shared by every subcommand that loads one."""
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=None,
                   help="HF model folder, .gguf file, or a name from `speculant models` (e.g. "
                        "qwen2.5-coder-1.5b-instruct, fetched on first use; ./NAME for a folder of that name) "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 | float16 (default auto: bfloat16 on CUDA, for a GGUF "
                        "file on the native kernels (any CPU with AVX2) and where the CPU has AMX or AVX512-BF16; "
                        "float32 elsewhere)")
    g.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    g.add_argument("--quantization", "-q", default="auto", choices=list(QUANTIZATIONS),
                   help="weight-only quantization of target and draft: int8 (per channel), int4 (groups of 32 "
                        "with scale and minimum, as GGUF Q4_1; CPU), none, or auto (default: a GGUF file runs at "
                        "the precision it stores, int4 for Q4 files, int8 for Q8_0; Hugging Face folders none)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every pass eagerly instead of replaying decode and verify passes from "
                        "CUDA graphs (as vLLM's flag)")
    g.add_argument("--threads", type=int, default=None,
                   help="PyTorch CPU threads (default: PyTorch's choice); on a machine shared with other "
                        "work, 1 avoids threads waiting on each other at every operation")
    return g


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Target, context and speculation flags shared by every subcommand that runs the engine."""
    g = add_target_arguments(p)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length served (default: the model's own, as far as the KV cache fits in a "
                        "quarter of the memory)")
    g.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (default 8)")
    c = p.add_argument_group("prefix cache and prefill (docs/server.md)")
    c.add_argument("--prefix-cache-gb", type=float, default=None,
                   help="memory for the keys and values of past requests, which a request starting the same "
                        "way reuses (default: an eighth of the memory, at most 4)")
    c.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt whole")
    c.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"the most prompt tokens a pass feeds (default {DEFAULT_PREFILL_CHUNK}; beside decoding, "
                        "about one decode step's worth); 0: every prompt in one pass, running streams wait")
    s = p.add_argument_group("speculation")
    s.add_argument("--speculative-config", default=None,
                   help='JSON object or a JSON/YAML file, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'; methods: draft_model (or draft), ngram, eagle; vLLM\'s '
                        'other names are refused with what to pass instead')
    s.add_argument("--draft-model", default=None, help="shortcut: a draft model path or a name from "
                   "`speculant models` (method draft_model), k = 4, with prompt lookup first, --draft-p-chain 0.7, "
                   "--draft-vocab-size 65536, a GGUF draft's wider matrices as Q4_0 and adaptive k for batches "
                   "(\"adaptive\": \"batched\"; at every batch size on CPUs below AVX512) unless given")
    s.add_argument("--draft-p-min", type=float, default=None,
                   help="with --draft-model: stop a draft where the draft's likeliest token is below P "
                        "(\"draft_p_min\"; 0: always k drafts)")
    s.add_argument("--draft-p-chain", type=float, default=None,
                   help="with --draft-model: stop a draft where the draft's probability of the tokens it drew "
                        "is below P (\"draft_p_chain\"; 0: off)")
    s.add_argument("--draft-vocab-size", type=int, default=None,
                   help="with --draft-model: the draft scores only the first N token ids and the special tokens "
                        "(\"draft_vocab_size\"; 0: the whole vocabulary)")
    s.add_argument("--eagle", default=None, help="shortcut: an EAGLE head folder (method eagle)")
    s.add_argument("--ngram", action="store_true", help="shortcut: prompt-lookup proposer (method ngram)")
    s.add_argument("--lookup-first", action="store_true",
                   help="with a draft model or EAGLE head: verify prompt-lookup drafts where the text repeats "
                        "(free), the model's drafts elsewhere (\"lookup_first\": true)")
    s.add_argument("--tree-width", type=int, default=None,
                   help="with an EAGLE head or a draft model: verify a draft tree of k + N - 1 nodes in one pass, N "
                        "children for each of the N likeliest nodes of a depth, the likeliest kept (\"tree_width\": "
                        "N, default 1; a draft model's: fewer nodes where the target's cost curve says so, chains "
                        "in a batch)")
    s.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="draft length k (default 4)")
    s.add_argument("--adaptive", action="store_true",
                   help="choose k per step from the measured cost curve and acceptance (0 where it loses)")
    s.add_argument("--history-tokens", type=int, default=None,
                   help="serving: draft from the target's last N tokens of answers where a sequence's last 8 "
                        "tokens appear in one (repeated requests; greedy rows), on top of prompt lookup "
                        "(\"history_tokens\": N; ~220 bytes a token). Opt-in: a request's speed then depends on "
                        "the requests before it")
    s.add_argument("--no-speculation", action="store_true",
                   help="plain decoding (k = 0); without any speculation flag the bundled model uses "
                        "its best measured proposer (n-gram lookup, k up to 4), adaptively, and a named model "
                        "with a sibling drafts with it as --draft-model does")


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    cfg = _speculative_config(args)
    if args.history_tokens is None:
        return cfg
    if cfg is None:
        raise SpeculantError("--history-tokens drafts from earlier answers beside prompt lookup: this run does "
                             "not speculate (add --ngram)")
    return SpeculativeConfig.parse({**asdict(cfg), "history_tokens": args.history_tokens})


def _speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.no_speculation:
        return None
    if args.speculative_config:
        cfg = SpeculativeConfig.parse(args.speculative_config)
        if args.num_speculative_tokens is not None:
            cfg.num_speculative_tokens = args.num_speculative_tokens
        cfg.adaptive = True if args.adaptive else cfg.adaptive
        if args.lookup_first or args.tree_width is not None:
            width = cfg.tree_width if args.tree_width is None else args.tree_width
            cfg = SpeculativeConfig.parse({**asdict(cfg), "lookup_first": cfg.lookup_first or args.lookup_first,
                                           "tree_width": width})
        return cfg
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else 4
    rules = {key: v for key, v in (("draft_p_min", args.draft_p_min), ("draft_p_chain", args.draft_p_chain),
                                   ("draft_vocab_size", args.draft_vocab_size)) if v is not None}
    if rules and not args.draft_model:
        raise SpeculantError("--draft-p-min, --draft-p-chain and --draft-vocab-size shape a draft model's drafts: "
                             "give --draft-model PATH with them")
    if args.draft_model:
        from speculant.defaults import DRAFT_K, draft_model_config

        k = DRAFT_K if args.num_speculative_tokens is None else args.num_speculative_tokens
        if args.adaptive:
            rules["adaptive"] = True
        if args.tree_width is not None:
            rules["tree_width"] = args.tree_width
        return SpeculativeConfig.parse(draft_model_config(args.draft_model, k, **rules))
    if args.eagle:
        return SpeculativeConfig.parse({"method": "eagle", "model": args.eagle, "num_speculative_tokens": k,
                                        "adaptive": args.adaptive, "lookup_first": args.lookup_first,
                                        "tree_width": 1 if args.tree_width is None else args.tree_width})
    if args.lookup_first:
        raise SpeculantError("--lookup-first puts prompt lookup ahead of a model's drafts: give --draft-model "
                             "PATH or --eagle PATH with it")
    if args.tree_width is not None:
        raise SpeculantError("--tree-width is the width of a draft tree: give --eagle PATH or --draft-model PATH "
                             "with it")
    if args.ngram or args.num_speculative_tokens is not None:
        return SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k, "adaptive": args.adaptive})
    # No flags: the bundled model speculates with its best measured proposer, adaptively (k per step,
    # off where it would lose); other models decode plainly. LLM() resolves its default the same way.
    from speculant.llm import resolve_speculative_config

    return resolve_speculative_config(args.model, "auto")


def engine_from_args(args: argparse.Namespace):
    from speculant.llm import build_engine

    if args.prefix_cache_gb is not None and args.prefix_cache_gb < 0:
        raise SpeculantError(f"--prefix-cache-gb must be at least 0, got {args.prefix_cache_gb:g}")
    if args.prefill_chunk < 0:
        raise SpeculantError(f"--prefill-chunk must be at least 0 (0: no chunks), got {args.prefill_chunk}")
    cache_bytes = None if args.prefix_cache_gb is None else int(args.prefix_cache_gb * 2**30)
    return build_engine(args.model, args.dtype, args.device, speculative_config_from_args(args),
                        args.max_batch_size, args.max_model_len, args.quantization,
                        cache_bytes if args.prefix_caching else 0, args.prefill_chunk)


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
    prompt_ids = tok.encode(args.prompt) if args.no_chat else tok.encode_chat(
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
    gen.add_argument("--no-chat", action="store_true", help="raw completion: no chat template")
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
        args.run(args)
    except SpeculantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
