"""The drafts shipped for the bundled SmolLM2-135M-Instruct, and what `generate` uses by default."""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-instruct"
# The best proposer on held-out prompts (python -m speculant.training.evaluate; results in
# eagle/evaluation.json). The shipped drafts, trained on 104k tokens in 20-30 minutes, agree with
# the target too rarely (acceptance 4-12%) to beat n-gram lookup, which does (0.9-1.1x on mixed
# prompts, far more on copy-heavy ones): it is the default until better drafts are trained.
# Adaptive mode switches speculation off where it does not pay.
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
