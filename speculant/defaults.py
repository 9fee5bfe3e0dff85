"""The runtime defaults: what `speculant generate`, `serve` and `bench` use when no flag says otherwise.

Why these values, with the runs behind them: docs/history.md ("The default").
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
PROMPT_LOOKUP = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}
SPECULATION = dict(PROMPT_LOOKUP)
# A draft model's drafting rules when the user names only the draft (--draft-model, a named model's default
# draft): prompt lookup first where the text repeats, drafts stopped before the next draft pass where the draft
# is unsure of what it drew (on chat it kept more of the gain than a bound on each position), a draft head over
# the 65,536 first ids of the vocabulary (most of a BPE's text; no effect on smaller vocabularies), and a GGUF
# draft's wider matrices as Q4_0 (its acceptance held, its pass cheaper).
DRAFT_RULES = {"lookup_first": True, "draft_p_chain": 0.7, "draft_vocab_size": 65536}
GGUF_DRAFT_RULES = {"draft_quantization": "q4_0"}
DRAFT_K = 4  # with p_min and a verify pass of 5 near one pass: k = 3 lost code's gain, chat held at both
# The shipped EAGLE head's draft tree width (the bench's +tree proposers).
TREE_WIDTH = 2
REQUIRED_FILES = {"eagle": ("eagle.safetensors", "eagle_config.json"),
                  "draft_model": ("config.json", "model.safetensors", "tokenizer.json")}


# Where a fixed k pays: on the avx512 and amx kernels a verify pass of a few rows costs little more than one.
# Below them (avx2, avxvnni, PyTorch's kernels) the int8 products are compute-bound from 2-4 rows and a fixed k
# loses: there k is chosen per step from the measured costs (adaptive), 0 where drafting would lose.
FLAT_VERIFY_LEVELS = ("avx512", "amx")


def draft_model_config(draft: str, k: int = DRAFT_K, **overrides) -> dict:
    """The speculative config of a draft model named alone: DRAFT_RULES (and GGUF_DRAFT_RULES for a GGUF draft),
    adaptive k below FLAT_VERIFY_LEVELS and, on them, for batches (a verify pass over several sequences is
    compute-bound where one sequence's is flat), then `overrides`. Chains: a tree (`tree_width`) drew level with
    the chain on AVX2 and lost seeded (docs/performance.md)."""
    from speculant.models import native
    from speculant.models.limits import ADAPTIVE_BATCHED
    from speculant.models.registry import gguf_draft

    adaptive = ADAPTIVE_BATCHED if native.level() in FLAT_VERIFY_LEVELS else True
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **DRAFT_RULES,
            **(GGUF_DRAFT_RULES if gguf_draft(draft) else {}), "adaptive": adaptive, **overrides}


def default_speculative_config(model_path: str | Path | None) -> dict | None:
    """The default speculative config: the bundled default model's (None: the default), a named model's own
    draft where it has one, or prompt lookup where it says so, else None: a draft only helps the target it was
    trained for."""
    from speculant.models.registry import MODELS, find, model_file

    named = None
    if model_path is not None:
        named = find(str(model_path)) or next(
            (m for m in MODELS.values() if Path(model_path).expanduser().resolve() == model_file(m).resolve()), None)
    if named is not None:
        if named.draft:
            return draft_model_config(named.draft)
        return dict(PROMPT_LOOKUP) if named.prompt_lookup else None
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
