"""What the row-invariant attention kernel costs (CUDA): a bf16 pass of 1 and 5 tokens at 160 cached
tokens, replayed from graphs, with the static passes' attention on PyTorch's math kernel and on cuDNN's;
and whether row 0 of the 5-token pass has the bits of the 1-token pass.

    python tools/attention_probe.py MODEL
"""

import statistics
import sys

import torch
from compile_probe import CONTEXT, timed_pass  # this script's folder is on the path
from torch.nn.attention import SDPBackend

from speculant.models import cuda_graphs
from speculant.models.loader import load_model


@torch.inference_mode()
def main() -> None:
    model = load_model(sys.argv[1], dtype="bfloat16", device="cuda").model
    slot = torch.tensor([0], device="cuda")
    tokens = torch.randint(model.cfg.vocab_size, (1, 5), device="cuda")
    prompt = torch.randint(model.cfg.vocab_size, (1, CONTEXT), device="cuda")
    for max_len in (256, 1024):
        for backend in (SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
            cuda_graphs.ATTENTION_BACKEND = backend
            cache = model.new_cache(1, max_len)
            model(prompt, cache, slot)
            rows, times = {}, {}
            for t in (1, 5):
                timed_pass(model, cache, tokens[:, :t], slot)  # captures
                times[t] = statistics.median(timed_pass(model, cache, tokens[:, :t], slot) for _ in range(200))
                cache.lengths[0] = CONTEXT
                rows[t] = model(tokens[:, :t], cache, slot)[0, 0].float()
            print(f"cache {max_len}, {backend.name}: pass {times[1] * 1e3:.3f} ms (1 token), {times[5] * 1e3:.3f} ms "
                  f"(5); row 0 alone vs among 5: {(rows[1] - rows[5]).abs().max().item():.3g}", flush=True)


if __name__ == "__main__":
    main()
