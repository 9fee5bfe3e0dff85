"""`speculant train-draft`: record self-distillation data (resumable), then train a draft."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from speculant.arguments import whole_number
from speculant.errors import SpeculantError
from speculant.training.train import KINDS, TrainConfig

log = logging.getLogger("speculant")


non_negative = whole_number(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="the target: HF folder or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--kind", "--method", dest="kind", choices=(*KINDS, "corpus"), required=True,
                   help="eagle: a one-layer head on the target's features; eagle3: an EAGLE-3 head on three of "
                        "its layers, trained with the training-time test, written in SpecForge's form (vLLM and "
                        "SGLang load it); "
                        "draft_model: a small standalone model; corpus: a table of what the target wrote "
                        "after each 2-3 tokens of its recorded answers (for ngram or lookup_first)")
    p.add_argument("--out", type=Path, required=True, help="folder the trained draft is written to")
    p.add_argument("--data", type=Path, default=None,
                   help="self-distillation data folder, shared between kinds; recorded there when missing or "
                        "incomplete (default: OUT/data)")
    p.add_argument("--more-data", type=Path, nargs="+", default=[], metavar="FOLDER",
                   help="data folders recorded earlier (other prompts or seeds), trained on with --data's")
    d = p.add_argument_group("data")
    d.add_argument("--text-chars", type=int, default=600_000, help="characters of teacher-forced text")
    d.add_argument("--prompts", type=int, default=160, help="prompts the target answers itself")
    d.add_argument("--answer-tokens", type=int, default=160, help="longest self-written answer")
    d.add_argument("--top-k", type=int, default=32, help="target log-probabilities kept per token")
    d.add_argument("--record-only", action="store_true", help="record the data, do not train")
    d.add_argument("--worker", type=int, default=0,
                   help="with --workers N: record every N-th shard from this one")
    d.add_argument("--workers", type=int, default=1, help="processes recording one data set together")
    t = p.add_argument_group("training")
    defaults = TrainConfig()
    t.add_argument("--epochs", type=float, default=defaults.epochs)
    t.add_argument("--max-minutes", type=float, default=defaults.max_minutes,
                   help="training stops (and its schedule ends) at this wall time if the epochs take longer")
    t.add_argument("--batch-size", type=int, default=defaults.batch_size)
    t.add_argument("--window", type=int, default=defaults.window, help="tokens per training window")
    t.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 1e-3 eagle, 2e-3 draft)")
    t.add_argument("--kl-weight", type=float, default=defaults.kl_weight,
                   help="eagle: weight of the KL to the target's distribution next to feature regression")
    t.add_argument("--kl-fraction", type=float, default=defaults.kl_fraction,
                   help="eagle: fraction of positions that pay for the full-vocabulary softmax")
    t.add_argument("--draft-vocab", type=non_negative, default=defaults.draft_vocab,
                   help="eagle: draft from the target's N most frequent next tokens in the data, a cheaper "
                        "head than the whole vocabulary (0: the whole vocabulary)")
    t.add_argument("--draft-dim", type=int, default=defaults.draft_dim, help="draft_model hidden size")
    t.add_argument("--draft-layers", type=int, default=defaults.draft_layers, help="draft_model layers")
    t.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                   help="eagle3: training-time-test steps (the head fed its own output for the later ones)")
    t.add_argument("--feature-cache-gb", type=float, default=defaults.feature_cache_gb,
                   help="eagle3: keep the target's features of the recorded sequences in memory up to this size "
                        "(fp32), read once instead of once per epoch (0: read every window's sequence each time)")
    t.add_argument("--checkpoint-every", type=non_negative, default=0, metavar="STEPS",
                   help="save a resumable checkpoint to OUT/checkpoint every STEPS steps; run the same command "
                        "again to resume from the last one (0: none)")
    t.add_argument("--device", default="auto",
                   help="where training runs: auto (CUDA when there is a GPU, else the CPU), cpu, cuda")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=whole_number(1), default=None,
                   help="torch CPU threads (default: torch's choice; 1 is fastest on a busy machine)")
    t.add_argument("--dtype", default="auto",
                   help="dtype the target runs in while recording (default auto, as `generate`: the features "
                        "a draft learns from are those of the target it will draft for)")
    t.add_argument("--quantization", default="auto", help="the target's weights while recording (as `generate`)")


def run(args: argparse.Namespace) -> int:
    import torch

    from speculant.models.loader import load_model
    from speculant.training.data import build_dataset, load_dataset, record_answers, recorded
    from speculant.training.train import train

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target = load_model(args.target, dtype=args.dtype, quantization=args.quantization)
    data_dir = args.data or args.out / "data"
    if args.kind == "corpus":
        # A table needs tokens only: an existing recording of either kind, else greedy answers alone.
        if not recorded(data_dir):
            record_answers(target, data_dir, n_prompts=args.prompts, answer_tokens=args.answer_tokens, seed=args.seed)
        return build_corpus(target, [data_dir, *args.more_data], args.out, t0)
    manifest = build_dataset(target, data_dir, n_text_chars=args.text_chars, n_prompts=args.prompts,
                             answer_tokens=args.answer_tokens, top_k=args.top_k, seed=args.seed,
                             worker=args.worker, workers=args.workers)
    if args.record_only:
        print(json.dumps(manifest, indent=2))
        return 0
    if not manifest["complete"]:
        raise SpeculantError(f"{data_dir}: the data set is incomplete (other workers still recording?)")
    folders = [data_dir, *args.more_data]
    data = load_dataset(folders)
    log.info("data: %d tokens in %d sequences (%s)", len(data["tokens"]), len(data["offsets"]) - 1,
             ", ".join(map(str, folders)))
    # Training runs in fp32 against the frozen target's plain layers (its last layer seeds the EAGLE
    # head; gradients flow through its lm_head), not the inference layout.
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    target = load_model(args.target, pack=False, device=device)
    cfg = TrainConfig(kind=args.kind, epochs=args.epochs, max_minutes=args.max_minutes,
                      batch_size=args.batch_size, window=args.window,
                      lr=args.lr or (1e-3 if args.kind in ("eagle", "eagle3") else 2e-3),
                      kl_weight=args.kl_weight, kl_fraction=args.kl_fraction, draft_vocab=args.draft_vocab,
                      draft_dim=args.draft_dim, ttt_steps=args.ttt_steps, checkpoint_every=args.checkpoint_every,
                      feature_cache_gb=args.feature_cache_gb,
                      draft_layers=args.draft_layers, seed=args.seed)
    summary = train(target, data, cfg, args.out)
    summary["data"] = {"folders": list(map(str, folders)), "tokens": len(data["tokens"]),
                       "sequences": len(data["offsets"]) - 1}
    summary["total_wall_time_s"] = round(time.perf_counter() - t0, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    return 0


def build_corpus(target, folders: list[Path], out: Path, t0: float) -> int:
    """The corpus table of every recorded sequence (prompts and the target's answers) → OUT/corpus.safetensors."""
    from speculant.proposers.corpus import FILE, CorpusTable
    from speculant.training.data import load_token_sequences

    table = CorpusTable.build(load_token_sequences(folders), target)
    table.save(out / FILE)
    summary = {**table.info, "entries": table.entries, "folders": list(map(str, folders)),
               "total_wall_time_s": round(time.perf_counter() - t0, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0
