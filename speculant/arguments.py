"""The flags every command that loads a model shares (generate, serve, bench, advise, train-draft's evaluation),
each with its help text once, and what they resolve to: a speculative config, an engine."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from speculant.config import (
    DEFAULT_PREFILL_CHUNK,
    EngineConfig,
    SpeculativeConfig,
    engine_config,
    resolve_speculative_config,
)
from speculant.errors import SpeculantError
from speculant.models.quantize import QUANTIZATIONS

DTYPE_HELP = ("auto | float32 | bfloat16 | float16 (default auto: bfloat16 on CUDA, for a GGUF file on the native "
              "kernels (any CPU with AVX2) and where the CPU has AMX or AVX512-BF16; float32 elsewhere)")
DEVICE_HELP = "cpu | cuda (default cpu)"


def whole_number(low: int, high: int | None = None):
    """An argparse type: an integer from `low` (to `high`), refused with the range it must be in."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {low} or more, got {value}" if high is None
                                             else f"expected {low} to {high}, got {value}")
        return value

    return parse


def add_target_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The target model's flags, shared by every subcommand that loads one."""
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=None,
                   help="HF model folder, .gguf file, or a name from `speculant models` (e.g. "
                        "qwen2.5-coder-1.5b-instruct, fetched on first use; ./NAME for a folder of that name) "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto",
                   help=DTYPE_HELP)
    g.add_argument("--device", default="cpu", help=DEVICE_HELP)
    g.add_argument("--quantization", "-q", default="auto", choices=list(QUANTIZATIONS),
                   help="weight-only quantization of target and draft: int8 (per channel), int4 (groups of 32 "
                        "with scale and minimum, as GGUF Q4_1; CPU), none, or auto (default: a GGUF file runs at "
                        "the precision it stores, int4 for Q4 files, int8 for Q8_0; Hugging Face folders none)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every pass eagerly instead of replaying decode and verify passes from "
                        "CUDA graphs (as vLLM's flag)")
    g.add_argument("--threads", type=whole_number(1), default=None,
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
    c.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="write the prefix cache's entries to DIR too (in the background), and read them back "
                        "after a restart; one subfolder per model, dtype, quantization and kernel build")
    c.add_argument("--prefix-cache-disk-gb", type=float, default=None,
                   help="with --prefix-cache-dir: the most the folder holds for this model, the least recently "
                        "used entries dropped first (default: a quarter of the free space, at most 16)")
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
        flags = {"num_speculative_tokens": args.num_speculative_tokens, "adaptive": True if args.adaptive else None,
                 "lookup_first": True if args.lookup_first else None, "tree_width": args.tree_width}
        given = {key: v for key, v in flags.items() if v is not None}
        return SpeculativeConfig.parse({**asdict(cfg), **given}) if given else cfg
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
    return resolve_speculative_config(args.model, "auto")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The flags through the one resolver (config.engine_config)."""
    if args.prefix_cache_gb is not None and args.prefix_cache_gb < 0:
        raise SpeculantError(f"--prefix-cache-gb must be at least 0, got {args.prefix_cache_gb:g}")
    cache_bytes = None if args.prefix_cache_gb is None else int(args.prefix_cache_gb * 2**30)
    disk_gb = args.prefix_cache_disk_gb
    if disk_gb is not None and (disk_gb < 0 or args.prefix_cache_dir is None):
        raise SpeculantError(f"--prefix-cache-disk-gb must be at least 0, got {disk_gb:g}" if disk_gb < 0 else
                             "--prefix-cache-disk-gb bounds the folder --prefix-cache-dir names: give that too")
    if args.prefix_cache_dir is not None and not args.prefix_caching:
        raise SpeculantError("--prefix-cache-dir keeps what the prefix cache holds: drop --no-enable-prefix-caching")
    return engine_config(args.model, speculative_config_from_args(args), dtype=args.dtype, device=args.device,
                         quantization=args.quantization, max_batch_size=args.max_batch_size,
                         max_model_len=args.max_model_len, prefix_cache_bytes=cache_bytes if args.prefix_caching else 0,
                         prefill_chunk=args.prefill_chunk, prefix_cache_dir=args.prefix_cache_dir,
                         prefix_cache_disk_bytes=None if disk_gb is None else int(disk_gb * 2**30))


def engine_from_args(args: argparse.Namespace):
    from speculant.llm import engine_from_config

    return engine_from_config(engine_config_from_args(args))
