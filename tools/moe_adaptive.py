"""Speculation on a mixture-of-experts target: its cost curve, and adaptive k against plain decoding.

A random-weight Qwen3-MoE (hidden 1024, 32 experts, top 4, 4 layers; a pass costs the same whatever the weights'
values, but which experts a pass runs depends on its tokens) in the engine's default dtype on this CPU. Prints
C(k+1)/C(1) for k = 0..8 at batch 1 and 4, as adaptive k measures it (speedup.measure_cost_curve), then decoding
time of plain decoding, adaptive k with a deliberately poor draft model (random weights: its drafts are rarely
right) and adaptive prompt lookup, at batch 1 and 4, interleaved (each round runs every configuration, the order
rotated): geometric means of plain's time over each configuration's (above 1: faster than plain) with a 95% t
interval over the rounds, beside a second plain engine's (the run's noise), and whether the outputs equal plain
decoding's.

    flock /tmp/speculant-timing.lock python tools/moe_adaptive.py [rounds 5] [max_tokens 48]
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import scipy.stats
import torch
import transformers

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.llm import engine_for
from speculant.models.loader import load_model
from speculant.speedup import measure_cost_curve

MOE = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
           head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=2048,
           norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
DRAFT = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)


def save(folder: Path, config: transformers.PretrainedConfig, seed: int) -> Path:
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def prompts(batch: int, round_: int) -> list[list[int]]:
    """Half repetitive (lookup finds drafts there), half not."""
    g = torch.Generator().manual_seed(round_ * 100 + batch)
    out = []
    for b in range(batch):
        base = torch.randint(3, 8192, (12,), generator=g).tolist()
        out.append(base * 3 if b % 2 == 0 else torch.randint(3, 8192, (36,), generator=g).tolist())
    return out


def main(rounds: int, max_tokens: int) -> None:
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="moe-adaptive-"))
    os.environ["SPECULANT_CACHE"] = str(root / "cache")  # a cost curve measured now, not one cached earlier
    target_dir = save(root / "target", transformers.Qwen3MoeConfig(**MOE), 0)
    draft_dir = save(root / "draft", transformers.LlamaConfig(**DRAFT), 1)
    target = load_model(target_dir, dtype="auto")
    print(f"target: Qwen3-MoE {MOE}, {target.model.dtype}, {torch.get_num_threads()} threads")
    curve = measure_cost_curve(target.model, [1, 4], max_width=9, context=128, reps=5)
    for b in (1, 4):
        ratios = " ".join(f"{curve.ratio(b, t):.2f}" for t in range(1, 10))
        print(f"batch {b}: C(1) {1e3 * curve.cost(b, 1):.1f} ms, C(k+1)/C(1) for k = 0..8: {ratios}")
    # "plain again" is plain decoding once more: its ratio to plain is the run's noise, the floor the others are read
    # against.
    specs = {"plain": None, "plain again": None,
             "poor-draft": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4,
                            "adaptive": True},
             "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for batch in (1, 4):
        engines = {n: engine_for(target, SpeculativeConfig.parse(s), batch, 512) for n, s in specs.items()}
        seconds: dict[str, list[float]] = {n: [] for n in specs}
        outputs: dict[str, list] = {n: [] for n in specs}
        names = list(specs)
        for r in range(rounds + 1):
            for name in names[r % len(names):] + names[:r % len(names)]:
                engine = engines[name]
                seqs = [engine.add_request(p, params) for p in prompts(batch, r)]
                start = time.perf_counter()
                engine.generate(seqs)
                if r:  # round 0 warms every engine up (and measures the adaptive engines' curves)
                    seconds[name].append(time.perf_counter() - start)
                if r:
                    outputs[name].append([s.output_ids for s in seqs])
        for name in names[1:]:
            logs = [math.log(p / s) for p, s in zip(seconds["plain"], seconds[name])]
            ratio = math.exp(statistics.mean(logs))
            half = scipy.stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            stats = engines[name].stats
            same = sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
            plain_s, own_s = statistics.median(seconds["plain"]), statistics.median(seconds[name])
            print(f"batch {batch} {name:11s}: {ratio:.3f}x plain's speed (95% CI {ratio / math.exp(half):.3f}-"
                  f"{ratio * math.exp(half):.3f}; plain {plain_s:.2f} s, {own_s:.2f} s), "
                  f"outputs equal plain's {same}/{rounds}, drafted {stats.num_draft_tokens}, "
                  f"accepted {stats.num_accepted_tokens}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, int(sys.argv[2]) if len(sys.argv) > 2 else 48)
