"""The drafts shipped for the bundled SmolLM2-135M-Instruct, and what `generate` uses by default."""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-instruct"
# The best proposer (speculant bench; int4, batch 1, 18 prompts x 128 tokens x 2, every configuration
# interleaved in one run). Prompt lookup first, the shipped EAGLE head where lookup finds nothing, with
# a draft tree of the head's 6 best first drafts, adaptive k: greedy 1.387x and 1.348x over k = 0 in two
# runs where n-gram lookup alone made 1.299x and 1.259x (lookup first without the tree 1.301x and 1.286x,
# a tie with lookup alone); sampled at temperature 0.7 a tie (1.087x vs 1.072x, three repetitions).
# Adaptive mode switches speculation off where it does not pay.
BEST = {"method": "eagle", "num_speculative_tokens": 6, "adaptive": True, "lookup_first": True, "tree_width": 6}
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
