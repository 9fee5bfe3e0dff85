"""json_schema answers with speculation against plain constrained decoding, on one engine each.

    python -m speculant.bench.structured [--model PATH] [--speculative-config JSON] [--rounds R] [--max-tokens N]

Both engines decode the same prompts under the same schemas, greedily (the answers must be identical:
checked). Rounds alternate plain and speculative so machine drift hits them alike; the fastest round of
each is kept. Prints a Markdown table: tokens/s, the speed-up, target passes per token, the grammar masks'
cost a token and each schema's compile time (first compile; a second costs a cache lookup).
"""

from __future__ import annotations

import argparse
import json
import time

from speculant.config import SamplingParams, StructuredOutputsParams
from speculant.engine import Engine
from speculant.llm import build_engine

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "email": {"type": "string"}}, "required": ["name", "age", "city", "email"], "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "product_name": {"type": "string"}, "price_in_euros": {"type": "number"}, "in_stock": {"type": "boolean"},
        "categories": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["product_name", "price_in_euros", "in_stock", "categories"], "additionalProperties": False},
    "weather_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
}
PROMPTS = {
    "person": ["Invent a person who lives in Lyon.", "Describe a software engineer from Berlin."],
    "product": ["Describe a coffee machine for sale.", "Describe a pair of running shoes for sale."],
    "weather_call": ["Call the weather tool for Paris.", "What is the weather in Tokyo? Use the tool."],
}


def requests(engine: Engine, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for name, prompts in PROMPTS.items():
        spec = StructuredOutputsParams(json=SCHEMAS[name])
        for prompt in prompts:
            messages = [{"role": "user", "content": f"{prompt} Answer in JSON."}]
            out.append((engine.tokenizer.encode_chat(messages),
                        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)))
    return out


def run(engine: Engine, work: list[tuple[list[int], SamplingParams]]) -> dict:
    """One request at a time (batch 1, where speculation pays) → its measures and answers."""
    passes = tokens = 0
    grammar_s, answers = engine.timing.grammar_s, []
    start = time.perf_counter()
    for ids, params in work:
        seq = engine.generate([engine.add_request(ids, params)])[0]
        passes += seq.stats.target_passes
        tokens += seq.num_generated
        answers.append(seq.output_ids)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "passes": passes, "answers": answers,
            "grammar_s": engine.timing.grammar_s - grammar_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder; default: the bundled SmolLM2")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    plain = build_engine(args.model, dtype="auto", quantization="auto", max_batch_size=1)
    spec = build_engine(args.model, dtype="auto", quantization="auto", max_batch_size=1,
                        speculative_config=args.speculative_config)
    compile_s = {}
    for name, schema in SCHEMAS.items():
        compiled = spec.grammars.compile(StructuredOutputsParams(json=schema))
        compile_s[name] = compiled.compile_s
    work = requests(plain, args.max_tokens)
    run(plain, work[:1]), run(spec, work[:1])  # warm-up
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, engine in (("plain", plain), ("speculative", spec)):
            result = run(engine, work)
            if label not in best or result["wall_s"] < best[label]["wall_s"]:
                best[label] = result
    assert best["plain"]["answers"] == best["speculative"]["answers"], "speculation changed a greedy answer"
    rate = {label: r["tokens"] / r["wall_s"] for label, r in best.items()}
    print(f"json_schema answers, greedy, batch 1, {len(work)} prompts, {args.rounds} rounds (fastest kept)\n")
    print("| decoding | tokens/s | target passes / token | grammar masks, µs / token |")
    print("| --- | --- | --- | --- |")
    for label, r in best.items():
        print(f"| {label} | {rate[label]:.1f} | {r['passes'] / r['tokens']:.2f} | "
              f"{1e6 * r['grammar_s'] / r['tokens']:.0f} |")
    print(f"\nspeed-up: {rate['speculative'] / rate['plain']:.2f}x ({args.speculative_config})")
    print("compile time, ms: " + json.dumps({k: round(1e3 * v, 2) for k, v in compile_s.items()}))


if __name__ == "__main__":
    main()
