"""Draft-model trees against the chain default on the real pair, counted, not timed: tokens and draft passes a target
pass, greedy, each output checked against plain decoding (docs/performance.md, "A draft model's trees").

    python tools/tree_passes.py 64        # max tokens a prompt

The cost curve that sizes the trees is a stand-in (the issue's avx512 figures): measuring one here would time passes
on a machine that may be busy, and cache the result for later runs.
"""

from __future__ import annotations

import sys

import torch

import speculant.adaptive as adaptive
from speculant.bench.prompts import load_prompts
from speculant.config import SamplingParams
from speculant.defaults import draft_model_config
from speculant.engine import Engine
from speculant.llm import build_engine
from speculant.speedup import CostCurve

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
STAND_IN = CostCurve(128, {b: [0.025 * b * (1 + 0.04 * t) for t in range(40)] for b in (1, 2, 4, 8)})
DRAFT_RATIO = 0.25  # a draft pass against a target pass: the 0.5B (Q4_0) against the 1.5B, docs/performance.md


def count_draft_passes(engine: Engine) -> list[int]:
    """Spy on the draft model: its passes while the engine proposes (its prefill left out), in a list of one."""
    proposer = getattr(engine.proposer, "model", engine.proposer)  # lookup first wraps the draft proposer
    seen, proposing = [0], [False]
    proposer.model.register_forward_pre_hook(lambda *_: seen.__setitem__(0, seen[0] + proposing[0]))
    propose = engine.propose

    def spy(batch, sb):
        proposing[0] = True
        try:
            return propose(batch, sb)
        finally:
            proposing[0] = False

    engine.propose = spy
    return seen


def main(max_tokens: int) -> None:
    torch.set_num_threads(2)
    adaptive.cost_curve_for = lambda *args, **kwargs: STAND_IN
    configs = {"plain": None, "chain": draft_model_config(DRAFT)}
    for width in (2, 3):
        configs[f"tree{width}"] = draft_model_config(DRAFT, tree_width=width)
        configs[f"tree{width}_pc0.4"] = draft_model_config(DRAFT, tree_width=width, draft_p_chain=0.4)
    plain: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for name, spec in configs.items():
        engine = build_engine(TARGET, dtype="auto", quantization="auto", speculative_config=spec, max_batch_size=1,
                              max_model_len=1024)
        prompts = load_prompts(["chat", "code"], engine.tokenizer, engine.model.cfg.vocab_size, per_class=4)
        draft_passes = count_draft_passes(engine) if spec is not None else [0]
        by_class: dict[str, dict] = {}
        for prompt in prompts:
            before = {w: n for w, (n, _) in engine.timing.passes.items()}
            drafted = draft_passes[0]
            seq = engine.generate([engine.add_request(prompt.token_ids, params)])[0]
            widths = {w: n - before.get(w, 0) for w, (n, _) in engine.timing.passes.items()}
            c = by_class.setdefault(prompt.prompt_class, {"tokens": 0, "passes": 0, "cost": 0.0, "draft": 0,
                                                          "same": True})
            c["tokens"] += len(seq.output_ids)
            c["passes"] += sum(widths.values())
            c["cost"] += sum(n * STAND_IN.ratio(1, w) for w, n in widths.items())
            c["draft"] += draft_passes[0] - drafted
            c["same"] &= plain.setdefault(prompt.id, seq.output_ids) == seq.output_ids
        for cls, c in by_class.items():
            estimate = c["tokens"] / (c["cost"] + DRAFT_RATIO * c["draft"])
            print(f"{name:14s} {cls:5s} tokens/pass {c['tokens'] / c['passes']:.2f} draft passes/pass "
                  f"{c['draft'] / c['passes']:.2f} C(w)/C(1) a pass {c['cost'] / c['passes']:.2f} "
                  f"estimated {estimate:.2f}x {'identical' if c['same'] else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
