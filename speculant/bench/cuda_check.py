"""On a CUDA GPU: does speculation stay lossless, and what do CUDA graphs buy?

    python -m speculant.bench.cuda_check [--model PATH] [--draft-model PATH] [--agreement-model PATH]

1. Row invariance: greedy speculative output equals plain output only if a verify pass scores each row
   as a one-token pass does. For each dtype, the largest difference between a row computed alone and
   the same row inside a product (and a masked attention) of 2..64 rows.
2. End to end, batch 1 and a batch of 4: plain decoding and speculation (prompt lookup, a draft model)
   with passes replayed from CUDA graphs, plain decoding and prompt lookup eagerly too: tokens/s (with
   graphs, after a round over the same prompts that captures them), and whether every output equals
   the plain output of the same precision and mode.
3. The bf16 cost curve with graphs at batch 1, 4 and 16: C(T)/C(1), what adaptive k plans with.
4. With --agreement-model (real weights): how often bf16 and int8 weights pick fp32's greedy token.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from speculant.adaptive import measure_cost_curve
from speculant.bench.prompts import PROMPT_CLASSES, load_prompts
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.llm import engine_for
from speculant.models.cuda_graphs import use_static_passes
from speculant.models.loader import default_model_path, load_model
from speculant.timing import EngineTiming

WIDTHS = range(2, 65)


def row_invariance(dtype: torch.dtype, dim: int = 576, out: int = 1536, keys: int = 300) -> dict[str, float]:
    """Largest |row 0 in a call of T rows − row 0 alone| over T in WIDTHS, for a linear layer, an lm_head
    shaped one and a masked attention."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    x, w, head = rand(max(WIDTHS), dim), rand(out, dim) / dim ** 0.5, rand(49152, dim) / dim ** 0.5
    q, k, v = rand(1, 9, max(WIDTHS), 64), rand(1, 3, keys, 64), rand(1, 3, keys, 64)

    def attention(t: int) -> torch.Tensor:
        first = keys - max(WIDTHS)
        allowed = torch.arange(keys, device="cuda")[None] <= first + torch.arange(t, device="cuda")[:, None]
        mask = torch.zeros(t, keys, device="cuda", dtype=dtype).masked_fill_(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q[:, :, :t], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

    checks = {"linear": lambda t: F.linear(x[:t], w)[0], "lm_head": lambda t: F.linear(x[:t], head)[0],
              "attention": attention}
    return {name: max((f(t).float() - f(1).float()).abs().max().item() for t in WIDTHS) for name, f in checks.items()}


def generate(engine, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[list[list[int]], float]:
    """Every prompt, `batch` at a time → (outputs, tokens per second)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs = [engine.add_request(p, params) for p in prompts[i:i + batch]]
        engine.generate(seqs)
        outputs += [s.output_ids for s in seqs]
        tokens += sum(len(s.output_ids) for s in seqs)
    torch.cuda.synchronize()
    return outputs, tokens / (time.perf_counter() - start)


def step_split(timing: EngineTiming) -> dict:
    """Tokens a step and where a step's time went: drafting, the target's pass, the rest (verification,
    bookkeeping), in ms."""
    steps = max(timing.steps, 1)
    return dict(tokens_per_step=timing.tokens / steps, draft_ms=1e3 * timing.draft_s / steps,
                target_ms=1e3 * timing.target_s / steps, other_ms=1e3 * timing.other_s / steps)


def end_to_end(path, dtype: str, quantization: str, specs: dict, prompts: list[list[int]], max_tokens: int,
               batch: int) -> list[dict]:
    """Each proposer of `specs` with graphs, plain decoding and the first proposer eagerly too;
    `identical`: outputs equal to plain decoding's in the same mode (for eager plain decoding: to plain
    decoding's with graphs)."""
    rows, plain = [], {}
    target = load_model(path, dtype=dtype, device="cuda", quantization=quantization)
    for graphs in (True, False):
        use_static_passes(target.model, replay=graphs)
        for name, spec in list(specs.items())[:None if graphs else 2]:
            engine = engine_for(target, SpeculativeConfig.parse(spec), batch, 1024)
            if graphs:
                generate(engine, prompts, max_tokens, batch)  # captures the graphs of every shape it meets
            engine.timing = EngineTiming()
            outputs, speed = generate(engine, prompts, max_tokens, batch)
            reference, base_speed = plain.setdefault(graphs, (outputs, speed))
            if spec is None and not graphs:
                reference = plain[True][0]
            same = sum(o == r for o, r in zip(outputs, reference))
            rows.append(dict(dtype=dtype, quantization=quantization, graphs=graphs, batch=batch, proposer=name,
                             tok_s=speed, speedup=speed / base_speed, identical=f"{same}/{len(outputs)}",
                             acceptance=engine.stats.acceptance_rate if spec else None,
                             **step_split(engine.timing)))
            print(rows[-1], flush=True)
    return rows


@torch.inference_mode()
def agreement(path, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy fp32 outputs, then each lower precision: outputs identical, tokens before the first
    difference, and its top-1 choice on fp32's outputs (teacher-forced)."""
    rows, reference = [], None
    for dtype, quantization in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")):
        target = load_model(path, dtype=dtype, device="cuda", quantization=quantization)
        outputs, _ = generate(engine_for(target, None, 1, 1024), prompts, max_tokens, 1)
        reference = reference or outputs
        same_prefix, agree, total = [], 0, 0
        for prompt, out, ref in zip(prompts, outputs, reference):
            same_prefix.append(next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref)))
            cache = target.model.new_cache(1, len(prompt) + len(ref) + 1)
            tokens = torch.tensor([prompt + ref], device="cuda")
            hidden = target.model(tokens, cache, torch.tensor([0], device="cuda"))
            choice = target.model.logits(hidden[0, len(prompt) - 1:-1]).argmax(-1)
            agree += int((choice == tokens[0, len(prompt):]).sum())
            total += len(ref)
        rows.append(dict(precision=f"{dtype}/{quantization}", identical=sum(o == r for o, r in zip(outputs, reference)),
                         prompts=len(prompts), mean_same_prefix=sum(same_prefix) / len(prompts),
                         top1=agree / total))
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--draft-model", default=None, help="a draft model for the draft_model proposer")
    p.add_argument("--agreement-model", default=None, help="a model with real weights for section 3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-class", type=int, default=2)
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| dtype | linear | lm_head | attention |  (largest |row alone − row in 2..64 rows|)\n|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        r = row_invariance(dtype)
        print(f"| {dtype} | {r['linear']:.3g} | {r['lm_head']:.3g} | {r['attention']:.3g} |", flush=True)
    path = args.model or default_model_path()
    probe = load_model(path, device="cuda")
    prompts = [b.token_ids for b in load_prompts(list(PROMPT_CLASSES), probe.tokenizer, probe.config.vocab_size,
                                                 per_class=args.per_class)]
    del probe
    specs = {"plain": None, "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4}}
    if args.draft_model:
        specs["draft_model k=4"] = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": 4}
    rows = []
    for dtype, quantization in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")):
        rows += end_to_end(path, dtype, quantization, specs, prompts, args.max_tokens, batch=1)
    rows += end_to_end(path, "bfloat16", "none", specs, prompts, args.max_tokens, batch=4)
    print("\n| dtype | weights | graphs | batch | proposer | tok/s | vs plain (same mode) | identical to plain "
          "| acceptance | tokens/step | ms/step: draft, target, rest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {r['dtype']} | {r['quantization']} | {'yes' if r['graphs'] else 'no'} | {r['batch']} | "
              f"{r['proposer']} | {r['tok_s']:.1f} | {r['speedup']:.2f} | {r['identical']} | {acc} | "
              f"{r['tokens_per_step']:.2f} | {r['draft_ms']:.2f}, {r['target_ms']:.2f}, {r['other_ms']:.2f} |")
    curve = measure_cost_curve(load_model(path, dtype="bfloat16", device="cuda").model, [1, 4, 16], max_width=16)
    print(f"\nbf16 with graphs, {curve.context} cached tokens: C(1) at batch 1 / 4 / 16 = "
          + " / ".join(f"{curve.seconds[b][0] * 1e3:.2f} ms" for b in (1, 4, 16)))
    widths = (2, 4, 6, 8, 12, 16)
    print("| batch | " + " | ".join(f"C({t})/C(1)" for t in widths) + " |\n|---|" + "---|" * len(widths))
    for b in (1, 4, 16):
        ratios = [curve.seconds[b][t - 1] / curve.seconds[b][0] for t in widths]
        print(f"| {b} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
    if args.agreement_model:
        probe = load_model(args.agreement_model, device="cuda")
        prompts = [b.token_ids for b in load_prompts(list(PROMPT_CLASSES), probe.tokenizer, probe.config.vocab_size,
                                                     per_class=args.per_class)]
        print("\n| precision | outputs identical to fp32 | mean tokens before a difference | top-1 = fp32's |")
        print("|---|---|---|---|")
        for r in agreement(args.agreement_model, prompts, args.max_tokens):
            print(f"| {r['precision']} | {r['identical']}/{r['prompts']} | {r['mean_same_prefix']:.1f} | "
                  f"{r['top1']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
