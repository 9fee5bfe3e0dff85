"""The drafts shipped for the bundled SmolLM2-135M-Instruct, and what `generate` uses by default."""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-instruct"
# The best proposer, measured side by side (int4, batch 1, greedy, 18 prompts x 128 tokens, every
# configuration interleaved in one run, 3 repetitions): prompt lookup first, the shipped EAGLE head where
# lookup finds nothing, drafting a draft tree, adaptive k: 1.432x and 1.448x in two runs with a width-3
# tree (the previous head 1.417x and 1.422x in the same runs); width 4 1.429x, k <= 8 1.438x: ties, and
# wider passes. Without lookup first 1.245x (previous head): lookup's long matches are right more often
# than the head's drafts. Since the int4 products read int8 activations a wider pass costs each row's
# dot products (C(5)/C(1) ~1.35 where it was ~1.1): 18 prompts x 96 and x 128 tokens, 2 repetitions,
# widths 1 / 2 / 3 / 4 interleaved: 1.210 / 1.228 / 1.182 / 1.172x and 1.223 / 1.227 / 1.179 / 1.191x
# (code 1.295 and 1.314x at width 2, 1.202 and 1.233x at 3); lookup alone, adaptive, 1.212 and 1.230x.
# Adaptive mode switches speculation off where it does not pay.
BEST = {"method": "eagle", "num_speculative_tokens": 6, "adaptive": True, "lookup_first": True, "tree_width": 2}
REQUIRED_FILES = {"eagle": ("eagle.safetensors", "eagle_config.json"),
                  "draft_model": ("config.json", "model.safetensors", "tokenizer.json")}


def default_speculative_config(model_path: str | Path | None) -> dict | None:
    """The best shipped draft's speculative config when `model_path` is the bundled default model
    (None: the default), else None: a draft only helps the target it was trained for."""
    try:
        default = default_model_path()
    except SpeculantError:
        return None
    if model_path is not None and Path(model_path).expanduser().resolve() != default.resolve():
        return None
    if BEST["method"] not in REQUIRED_FILES:
        return dict(BEST)  # model-free
    folder = SHIPPED / BEST["method"]
    if not all((folder / f).exists() for f in REQUIRED_FILES[BEST["method"]]):
        return None
    return {**BEST, "model": str(folder)}
