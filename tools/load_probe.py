"""What loading a model costs: seconds, peak resident memory against the file's size, which weights path it took,
and a few greedy tokens to show it runs. Run it twice: the first load builds the packed cache, the second reads it.

    python tools/load_probe.py MODEL.gguf [--tokens 16]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.llm import engine_for
from speculant.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    t0 = time.perf_counter()
    target = load_model(a.model, dtype="auto", quantization="auto")
    load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    size = a.model.stat().st_size
    print(f"{a.model.name}: {size / 2**30:.2f} GiB file, weights {target.quantization!r}, "
          f"cached {target.load_info.get('gguf_cached')}, load {load_s:.1f} s, peak RSS {peak / 2**30:.2f} GiB "
          f"= {peak / size:.2f}x the file")
    engine = engine_for(target, SpeculativeConfig.parse(None), 1, 256)
    seq = engine.add_request(list(range(100, 116)), SamplingParams(temperature=0, max_tokens=a.tokens,
                                                                 ignore_eos=True))
    t0 = time.perf_counter()
    engine.generate([seq])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{a.tokens} tokens in {time.perf_counter() - t0:.2f} s (with the prompt); peak RSS {peak / 2**30:.2f} GiB "
          f"= {peak / size:.2f}x the file; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
