"""The drafts shipped for the bundled SmolLM2-135M-Instruct, and what `generate` uses by default."""

from __future__ import annotations

from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.loader import default_model_path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-instruct"
# The best proposer, measured side by side (int4, batch 1, greedy, every configuration interleaved in one run).
# Since the int4 products read int8 activations (a pass 1.25x cheaper at one token, a wider pass paying each
# row's dot products), on the bench's 18 prompts x 128 tokens, 2 repetitions: prompt lookup, with the shipped
# corpus table where it matches fewer than 2 tokens, adaptive k <= 6: 1.390x over plain (code 1.522x, chat
# 1.230x, rewrite 1.521x); lookup alone 1.228x; the EAGLE head behind lookup (width-2 tree) 1.217x, with the
# corpus too 1.337x. On the 6 held-out prompts of training/evaluate.py x 3: 1.380x, lookup alone 1.236x,
# the head 1.257x, the head with the corpus 1.347x; k <= 8 1.386x.
# Before int8 activations the head behind lookup was the best (width 3: 1.432x and 1.448x in two runs,
# lookup alone ~1.3x); now its drafting pass (~0.4 ms a step) and its wider verify passes cost more than
# its drafts win over the table's. Adaptive mode switches speculation off where it does not pay.
# Session 20, lookup and the table, adaptive k <= 4 against <= 6 (the default before), every configuration
# interleaved: bench prompts x 128 tokens, greedy 1.442x / 1.447x against 1.419x / 1.429x (two runs, 2
# repetitions each), at temperature 0.7 1.240x against 1.228x; the 6 held-out prompts x 3, greedy 1.478x
# against 1.461x. A 7-token pass costs 1.63 plain ones in the decoding loop against 1.30 for 5 tokens: the
# long copies k = 6 catches pay less than its misjudged steps cost. (Fixed k = 3 made 1.458x / 1.459x and
# 1.272x there, but a fixed k loses in batches: k = 4 made 0.62x plain at batch 4 in the bench, where adaptive
# k switches itself off.)
BEST = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}
CORPUS = SHIPPED / "corpus" / "corpus.safetensors"
# The shipped EAGLE head's draft tree width: widths 1 / 2 / 3 / 4 behind lookup, 18 prompts x 96 and x 128
# tokens: 1.21 / 1.23 / 1.18 / 1.17x and 1.22 / 1.23 / 1.18 / 1.19x (code 1.30 and 1.31x at width 2).
TREE_WIDTH = 2
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
    config = dict(BEST)
    if BEST["method"] in REQUIRED_FILES:
        folder = SHIPPED / BEST["method"]
        if not all((folder / f).exists() for f in REQUIRED_FILES[BEST["method"]]):
            return None
        config["model"] = str(folder)
    if CORPUS.exists():
        config["corpus"] = str(CORPUS)
    return config
