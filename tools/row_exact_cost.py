"""Plain decoding's speed on a Hugging Face folder at one dtype: prompt tokens/s and decode tokens/s at batch 1
and 4. Run it from two checkouts (the row-exact kernels and the commit before them) to see what exactness
costs (docs/performance.md, "Row-exact kernels").

    python tools/random_smollm2.py /tmp/smol && python tools/row_exact_cost.py /tmp/smol --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from speculant.config import SamplingParams
from speculant.llm import LLM


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, speculative_config=None, max_batch_size=4, max_model_len=1024)
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:  # fresh tokens each time: no cached prefix to reuse
        return torch.randint(100, 30000, (n, length), generator=gen).tolist()

    timed(llm, prompts(1, 16), 4)  # first passes
    out = {"dtype": args.dtype, "threads": args.threads}
    out["prompt_tok_s"] = statistics.median(args.prompt / timed(llm, prompts(1, args.prompt), 1)
                                            for _ in range(args.reps))
    for batch in (1, 4):
        # Decode time alone: a run of `tokens` minus a run of 1 on prompts of the same length.
        rates = []
        for _ in range(args.reps):
            full, first = timed(llm, prompts(batch, 32), args.tokens), timed(llm, prompts(batch, 32), 1)
            rates.append(batch * (args.tokens - 1) / (full - first))
        out[f"decode_tok_s_batch{batch}"] = statistics.median(rates)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
