"""Does torch.compile pay inside the CUDA graphs? One bf16 model, passes of 1 and 5 tokens at 160 cached
tokens: replayed from graphs of the eager pass and of the compiled pass (default mode, fixed shapes).
Prints compile time, pass time (median of 200) and whether a row scores alike in 1- and 5-token passes.

    python tools/compile_probe.py MODEL
"""

import statistics
import sys
import time

import torch

from speculant.models.loader import load_model

CONTEXT, WIDTHS = 160, (1, 5)


def timed_pass(model, cache, tokens, slot) -> float:
    cache.lengths[0] = CONTEXT
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.logits(model(tokens, cache, slot))
    torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    model = load_model(sys.argv[1], dtype="bfloat16", device="cuda").model
    slot = torch.tensor([0], device="cuda")
    tokens = torch.randint(model.cfg.vocab_size, (1, max(WIDTHS)), device="cuda")
    for compiled in (False, True):
        cache = model.new_cache(1, 1024)
        model(torch.randint(model.cfg.vocab_size, (1, CONTEXT), device="cuda"), cache, slot)
        graphs = model.graphs_for(cache)
        if compiled:
            graphs.static_pass = torch.compile(graphs.static_pass, dynamic=False, fullgraph=True)
        rows = {}
        for t in WIDTHS:
            start = time.perf_counter()
            timed_pass(model, cache, tokens[:, :t], slot)
            capture_s = time.perf_counter() - start
            median = statistics.median(timed_pass(model, cache, tokens[:, :t], slot) for _ in range(200))
            cache.lengths[0] = CONTEXT
            rows[t] = model(tokens[:, :t], cache, slot)[0, 0].float()
            print(f"compiled={compiled} T={t}: first pass (compile + capture) {capture_s:.1f} s, "
                  f"pass {median * 1e3:.3f} ms", flush=True)
        print(f"compiled={compiled}: row 0 alone vs in a 5-token pass, largest difference "
              f"{(rows[1] - rows[5]).abs().max().item():.3g}", flush=True)


if __name__ == "__main__":
    main()
