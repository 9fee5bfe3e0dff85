"""The drafts shipped for the bundled SmolLM2-135M-Instruct, and what `generate` uses by default."""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-instruct"
# The best proposer (python -m speculant.training.evaluate: eagle/evaluation.json; speculant bench).
# The shipped EAGLE head gains 1.08-1.16x at k = 1 (int4, batch 1), n-gram lookup 1.26-1.35x on the
# bench prompts (far more on copy-heavy ones); lookup first with the head as fallback measured the
# same as lookup alone (1.34x vs 1.35x, 18 prompts, one run), so lookup stays the default until a
# better draft is trained. Adaptive mode switches speculation off where it does not pay.
BEST = {"method": "ngram", "num_speculative_tokens": 6, "adaptive": True}
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
