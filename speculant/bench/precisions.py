"""Batch-1 cost curves of one model at several precisions, measured side by side.

    python -m speculant.bench.precisions [--model PATH] [--threads N] [--rounds R] [--device cuda]

Every precision is loaded once; then, round after round, each width T = 1..max is timed on every
precision in turn (so machine drift hits them alike) and the fastest of the rounds is kept. Prints a
Markdown table: C(1), the weight bytes streamed per pass over C(1), and C(T)/C(1).
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.arguments import DEVICE_HELP, whole_number
from speculant.models.cuda_graphs import use_static_passes
from speculant.models.loader import LoadedModel, default_model_path, load_model

PRECISIONS = {
    "float32": dict(dtype="float32"),
    "float32, plain nn.Linear layout": dict(dtype="float32", pack=False),
    "bfloat16": dict(dtype="bfloat16"),
    "int8 weights, bf16 activations": dict(dtype="bfloat16", quantization="int8"),
    "int4 weights, int8 activations": dict(dtype="bfloat16", quantization="int4"),
}
# On CUDA, each precision with its passes replayed from CUDA graphs and run eagerly (kernel launches).
CUDA_PRECISIONS = {
    "float32": dict(dtype="float32"),
    "float32, eager": dict(dtype="float32", eager=True),
    "bfloat16": dict(dtype="bfloat16"),
    "bfloat16, eager": dict(dtype="bfloat16", eager=True),
    "int8 weights, bf16 activations": dict(dtype="bfloat16", quantization="int8"),
    "int8 weights, bf16 activations, eager": dict(dtype="bfloat16", quantization="int8", eager=True),
}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a pass streams: every weight of the decoder layers and the lm_head (the embedding is
    read one row per token)."""
    parts = [model.model.layers, model.model.norm, model.lm_head]
    return sum(t.numel() * t.element_size() for m in parts for t in [*m.parameters(), *m.buffers()])


def measure(models: dict[str, LoadedModel], widths: list[int], rounds: int, context: int = 160) -> dict:
    best = {name: [float("inf")] * len(widths) for name in models}
    caches = {name: lm.model.new_cache(1, context + max(widths) + 1) for name, lm in models.items()}
    device = next(iter(models.values())).model.device
    slot = torch.tensor([0], device=device)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms kernels up
            for i, t in enumerate(widths):
                for name, lm in models.items():
                    cache = caches[name]
                    cache.lengths[0] = context
                    tokens = torch.randint(lm.config.vocab_size, (1, t), generator=gen).to(device)
                    start = time.perf_counter()
                    lm.model.logits(lm.model(tokens, cache, slot))
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if r:
                        best[name][i] = min(best[name][i], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=whole_number(1), default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-width", type=int, default=8)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    cuda = args.device == "cuda"
    models = {}
    for name, kw in (CUDA_PRECISIONS if cuda else PRECISIONS).items():
        kw = dict(kw)
        eager = kw.pop("eager", False)
        models[name] = load_model(path, device=args.device, **kw)
        if eager:
            use_static_passes(models[name].model, replay=False)
    widths = list(range(1, args.max_width + 1))
    best = measure(models, widths, args.rounds)
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"{where}, batch 1, 160 cached tokens, fastest of {args.rounds} rounds\n")
    print("| precision | C(1) ms | GB/s at T=1 | " + " | ".join(f"C({t})/C(1)" for t in widths[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(widths) - 1))
    for name, times in best.items():
        gbps = weight_bytes(models[name].model) / times[0] / 1e9
        print(f"| {name} | {times[0] * 1e3:.3g} | {gbps:.1f} | " + " | ".join(f"{t / times[0]:.2f}" for t in times[1:])
              + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
