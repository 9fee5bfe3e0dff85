"""Phi-3 from a Hugging Face folder: its fused qkv and gate_up tensors and LongRoPE, against transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_tiny, transformers
from test_models import PHI3_LONGROPE

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers import build_proposer

PROMPTS = [[5, 17, 33, 8, 60, 12], [40, 41, 42, 40, 41, 42, 40], [90, 3, 77, 21, 14, 9, 55, 31, 2 + 60]]
N_TOKENS = 32


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("phi3") / "phi3", transformers.Phi3Config, seed=4, init_std=0.1,
                     pad_token_id=0, **PHI3_LONGROPE)


def speculant_greedy(target, prompt: list[int], spec: dict | None = None) -> list[int]:
    cfg = SpeculativeConfig.parse(spec)
    k = cfg.num_speculative_tokens if cfg else 0
    proposer = build_proposer(cfg, target, 1, 128 + k + 1) if cfg else None
    engine = Engine(target, proposer, k, max_batch_size=1, max_model_len=128)
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    return engine.generate([seq])[0].output_ids


def test_greedy_tokens_equal_transformers_generate(phi3):
    ref = transformers.AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32).eval()
    target = load_model(phi3)
    assert target.config.max_position_embeddings == 256  # served up to the pretrained context
    for prompt in PROMPTS:
        with torch.no_grad():  # no end token: every request writes N_TOKENS (ignore_eos above)
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert speculant_greedy(target, prompt) == expected
        assert speculant_greedy(target, prompt, {"method": "ngram", "num_speculative_tokens": 4}) == expected


def test_partial_rotary_is_refused_with_a_reason(phi3, tmp_path):
    """Phi-4-mini rotates 3/4 of each head: refused with the reason, not loaded wrong."""
    folder = tmp_path / "phi4"
    shutil.copytree(phi3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["partial_rotary_factor"] = cfg["rope_parameters"]["partial_rotary_factor"] = 0.75
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculantError, match="partial rotary embeddings"):
        load_model(folder)
