"""The runtime defaults: what `speculant generate`, `serve` and `bench` use when no flag says otherwise.

Why these values, with the runs behind them: docs/benchmarks/README.md ("The default").
"""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

# The drafts trained for the bundled SmolLM2-135M-Instruct.
SHIPPED = Path(__file__).resolve().parent / "data" / "drafts" / "smollm2-135m-instruct"
CORPUS = SHIPPED / "corpus" / "corpus.safetensors"
# The bundled model's speculation: prompt lookup, the corpus table where lookup matches little, and adaptive k,
# which switches speculation off where it would lose (large batches).
SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}
# The shipped EAGLE head's draft tree width (the bench's +tree proposers).
TREE_WIDTH = 2
REQUIRED_FILES = {"eagle": ("eagle.safetensors", "eagle_config.json"),
                  "draft_model": ("config.json", "model.safetensors", "tokenizer.json")}


def default_speculative_config(model_path: str | Path | None) -> dict | None:
    """The default speculative config when `model_path` is the bundled default model (None: the default),
    else None: a draft only helps the target it was trained for."""
    try:
        default = default_model_path()
    except SpeculantError:
        return None
    if model_path is not None and Path(model_path).expanduser().resolve() != default.resolve():
        return None
    config = dict(SPECULATION)
    method = SPECULATION["method"]
    if method in REQUIRED_FILES:
        folder = SHIPPED / method
        if not all((folder / f).exists() for f in REQUIRED_FILES[method]):
            return None
        config["model"] = str(folder)
    if CORPUS.exists():
        config["corpus"] = str(CORPUS)
    return config
