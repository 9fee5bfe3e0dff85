"""The drafts shipped for the bundled SmolLM2-135M-Instruct, and which one `generate` uses."""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-instruct"
# The best of the shipped drafts on held-out prompts (python -m speculant.training.evaluate), in
# adaptive mode: it speculates where its drafts pay (code) and switches itself off where they do
# not (open chat, which its stdlib-made training data barely covers).
BEST = {"method": "eagle", "num_speculative_tokens": 4, "adaptive": True}
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
    folder = SHIPPED / BEST["method"]
    if not all((folder / f).exists() for f in REQUIRED_FILES[BEST["method"]]):
        return None
    return {**BEST, "model": str(folder)}
