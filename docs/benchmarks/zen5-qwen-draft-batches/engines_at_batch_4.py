"""The named model's default (adaptive "batched") against plain decoding and a fixed k, at batch 4 and 1: total
tokens/s of generate() (prefill included), the three engines interleaved over the same prompts."""
import time
from dataclasses import replace

import torch

from speculant.bench.prompts import load_prompts
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.defaults import default_speculative_config
from speculant.llm import engine_for
from speculant.models.loader import load_model

torch.set_num_threads(2)
target = load_model("qwen2.5-coder-1.5b-instruct", dtype="auto", quantization="auto")
spec = SpeculativeConfig.parse(default_speculative_config("qwen2.5-coder-1.5b-instruct"))
print(spec)
prompts = load_prompts(["code", "chat"], target.tokenizer, target.config.vocab_size, per_class=4)
params = SamplingParams(temperature=0, max_tokens=96)
engines = {"plain": engine_for(target, None, 4, 1024), "default": engine_for(target, spec, 4, 1024),
           "fixed": engine_for(target, replace(spec, adaptive=False), 4, 1024)}
names = list(engines)
res: dict = {}
for B in (4, 1):
    for rep in range(2):
        for group in range(0, len(prompts), B):
            shift = (group // B + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                engine = engines[name]
                seqs = [engine.add_request(p.token_ids, params) for p in prompts[group:group + B]]
                t0 = time.perf_counter()
                engine.generate(seqs)
                res.setdefault((B, name), []).append((sum(len(s.output_ids) for s in seqs), time.perf_counter() - t0))


def rate(B: int, name: str) -> float:
    return sum(n for n, _ in res[(B, name)]) / sum(d for _, d in res[(B, name)])


for B, name in sorted(res):
    print(B, name, f"{rate(B, name):.1f} tok/s", f"{rate(B, name) / rate(B, 'plain'):.2f}x")
