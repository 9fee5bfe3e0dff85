"""Draft-model configurations side by side on the real pair, batch 1, interleaved in one process (each prompt runs
every configuration, the order rotated), decode tokens/s over plain decoding's on the same prompts: geometric means of
the per-prompt ratios, and how many outputs equal plain decoding's (docs/performance.md). Quicker than
`speculant bench` for a few adaptive configurations over all the bench's code and chat prompts.

    python tools/draft_ab.py '{"chain": {"tree_width": 1}, "tree2": {"tree_width": 2}}' [per_class 8] [temperature 0]

Each configuration is the `--draft-model` default with its overrides (`{}`: the default itself); at a
temperature above 0 requests are seeded (a name ending in "-u": unseeded).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from speculant.bench.prompts import PROMPTS_DIR
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.defaults import draft_model_config
from speculant.llm import engine_for
from speculant.models.loader import load_model

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main(configs: dict, per_class: int, temperature: float) -> None:
    torch.set_num_threads(2)
    target = load_model(TARGET, dtype="auto", quantization="auto")
    engines = {"plain": engine_for(target, None, 1, 4096)}
    for name, overrides in configs.items():
        engines[name] = engine_for(target, SpeculativeConfig.parse(draft_model_config(DRAFT, **overrides)), 1, 4096)
    tokenizer = engines["plain"].tokenizer
    prompts = [(cls, json.loads(line)["prompt"]) for cls in ("code", "chat")
               for line in (PROMPTS_DIR / f"{cls}.jsonl").read_text().splitlines()[:per_class]]
    names = list(engines)
    speed: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    for i, (_, text) in enumerate(prompts):
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        for name in names[i % len(names):] + names[:i % len(names)]:
            seeded = temperature > 0 and not name.endswith("-u")
            seq = engines[name].add_request(ids, SamplingParams(temperature=temperature, max_tokens=96,
                                                                seed=i if seeded else None))
            engines[name].generate([seq])
            speed[name].append(seq.metrics()["tokens_per_s"])
            outputs[name].append(seq.output_ids)
    for name in names:
        for cls in ("code", "chat", "all"):
            rows = [i for i, (c, _) in enumerate(prompts) if cls in (c, "all")]
            ratio = statistics.geometric_mean(speed[name][i] / speed["plain"][i] for i in rows)
            same = sum(outputs[name][i] == outputs["plain"][i] for i in rows)
            print(f"{name:12s} {cls:5s} {statistics.mean(speed[name][i] for i in rows):6.1f} tok/s "
                  f"{ratio:.3f}x plain, identical {same}/{len(rows)}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8,
         float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
