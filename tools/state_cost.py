"""What a hybrid model's exact rollback costs, as a share of one target pass (docs/performance.md, "Hybrid models"):
a verify pass of T tokens keeping the state after each of its positions (what the engine does, so that any
accepted length is a pick) against the same pass keeping only its end; and one recurrence step of every DeltaNet
layer, what replaying each accepted token would cost instead (the other way to roll back exactly).

    python tools/state_cost.py MODEL.gguf --widths 1,2,4,5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speculant.models.loader import load_model
from speculant.models.state_cache import HybridCache


def timed_pass(model, cache, tokens: torch.Tensor, start: int) -> float:
    """Seconds of a pass over `tokens` from length `start`, rolled back after."""
    t0 = time.perf_counter()
    with torch.no_grad():
        model.logits(model(tokens, cache, torch.tensor([0]))[:, -1:])
    seconds = time.perf_counter() - t0
    cache.set_lengths([0], [start])
    return seconds


def recurrence_step(cfg, layers: int, reps: int) -> float:
    """Median seconds of one token's state update and read-out in every DeltaNet layer (gdn.GatedDeltaNet's loop
    body), at the model's shape."""
    h, dk, dv = cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    state = torch.randn(1, h, dk, dv)
    k, q, v = torch.randn(1, h, dk, 1), torch.randn(1, h, dk), torch.randn(1, h, dv)
    decay, beta = torch.rand(1, h, 1, 1), torch.rand(1, h, 1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(layers):
            s = state * decay
            delta = (v - (s * k).sum(dim=-2)) * beta
            s = s + k * delta[:, :, None, :]
            (s * q[..., None]).sum(dim=-2)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--widths", default="1,2,4,5")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype="auto", quantization="auto")
    model, cfg = target.model, target.config
    if not cfg.linear_layers:
        raise SystemExit(f"{args.model}: not a hybrid model (no Gated DeltaNet layers)")
    cache = model.new_cache(1, args.prompt + 64)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=gen)
    with torch.no_grad():
        model(prompt, cache, torch.tensor([0]))
    keep_all = HybridCache.positions_to_keep

    def keep_end(self, slots, starts, n_real, T):  # the pass's last position only
        keep = [[] for _ in range(T)]
        for row, n in enumerate(n_real):
            keep[n - 1].append(row)
        return keep

    base = None
    for T in [int(w) for w in args.widths.split(",")]:
        tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
        timed_pass(model, cache, tokens, args.prompt)  # warm-up
        runs: dict[str, list[float]] = {"every": [], "end": []}
        for _ in range(args.reps):  # interleaved: the machine's drift falls on both alike
            for kind, keep in (("every", keep_all), ("end", keep_end)):
                HybridCache.positions_to_keep = keep
                try:
                    runs[kind].append(timed_pass(model, cache, tokens, args.prompt))
                finally:
                    HybridCache.positions_to_keep = keep_all
        every, end = statistics.median(runs["every"]), statistics.median(runs["end"])
        base = base or end
        print(f"T={T}: C(T)/C(1) {every / base:.2f}; keeping every position's state {every * 1e3:.1f} ms, only the "
              f"end {end * 1e3:.1f} ms: {(every - end) / base:+.1%} of one pass")
    step = recurrence_step(cfg, len(cfg.linear_layers), args.reps * 4)
    print(f"replaying one accepted token's recurrence in {len(cfg.linear_layers)} DeltaNet layers: {step * 1e3:.2f} ms "
          f"= {step / base:.1%} of one pass (C(1) {base * 1e3:.1f} ms)")
    matrix, window = model.model.layers[cfg.linear_layers[0]].linear_attn.state_shapes()
    per_position = len(cfg.linear_layers) * (torch.Size(matrix).numel() * 4 + torch.Size(window).numel() * 2)
    print(f"a row's states held per kept position: {per_position / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
