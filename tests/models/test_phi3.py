"""Phi-3 from a Hugging Face folder: its fused qkv and gate_up tensors and LongRoPE, against transformers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import save_tiny, transformers
from test_models import PHI3_LONGROPE

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.llm import engine_for
from speculant.models.loader import load_model

PROMPTS = [[5, 17, 33, 8, 60, 12], [40, 41, 42, 40, 41, 42, 40], [90, 3, 77, 21, 14, 9, 55, 31, 2 + 60]]
N_TOKENS = 32


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("phi3") / "phi3", transformers.Phi3Config, seed=4, init_std=0.1,
                     pad_token_id=0, **PHI3_LONGROPE)


def speculant_greedy(target, prompt: list[int], spec: dict | None = None) -> list[int]:
    engine = engine_for(target, SpeculativeConfig.parse(spec), 1, 128)
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


def test_sliding_window_is_honoured(tmp_path):
    """Phi-3-mini states a window of 2047 and transformers applies it: a window of 8 over 24 tokens shows it."""
    folder = save_tiny(tmp_path / "phi3w", transformers.Phi3Config, seed=4, init_std=0.1, pad_token_id=0,
                       sliding_window=8)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    model = load_model(folder).model
    with torch.no_grad():
        expected = ref(ids).logits
        got = model.logits(model(ids, model.new_cache(1, 64), torch.tensor([0])))
    assert model.cfg.sliding_window == 8
    assert (got - expected).abs().max().item() <= 1e-4


# Phi-4-mini's layout: 3/4 of each head rotates, LongRoPE factors for those dims only.
PHI4_MINI = dict(PHI3_LONGROPE, partial_rotary_factor=0.75,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                               "long_factor": [2.0 + 0.2 * i for i in range(6)]})


@pytest.fixture(scope="module")
def phi4(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("phi4") / "phi4", transformers.Phi3Config, seed=6, init_std=0.1,
                     pad_token_id=0, **PHI4_MINI)


def logits_of(target, ids: torch.Tensor) -> torch.Tensor:
    model = target.model
    with torch.no_grad():
        return model.logits(model(ids, model.new_cache(1, 64), torch.tensor([0]))).float()


def test_partial_rotary_matches_transformers(phi4):
    ref = transformers.AutoModelForCausalLM.from_pretrained(phi4, dtype=torch.float32).eval()
    target = load_model(phi4)
    assert target.config.rotary_dim == 12
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids).logits
    assert (logits_of(target, ids) - expected).abs().max().item() <= 1e-4
    for prompt in PROMPTS:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        expected_tokens = out[0, len(prompt):].tolist()
        assert speculant_greedy(target, prompt) == expected_tokens
        assert speculant_greedy(target, prompt, {"method": "ngram", "num_speculative_tokens": 4}) == expected_tokens


def test_rotary_layout_has_power(phi4, monkeypatch):
    """Rotating the checkpoint's dims in place (no layout) pairs the wrong dims: the logits move far."""
    from speculant.models import rope

    right = logits_of(load_model(phi4), torch.arange(3, 27)[None])
    monkeypatch.setattr(rope, "rotary_layout", lambda head_dim, _rotary_dim: torch.arange(head_dim))
    wrong = logits_of(load_model(phi4), torch.arange(3, 27)[None])
    assert (right - wrong).abs().max().item() > 1e-2


def test_partial_rotary_state_dict_is_the_checkpoints(phi4):
    from safetensors.torch import load_file

    saved = load_file(str(phi4 / "model.safetensors"))
    state = load_model(phi4, pack=False).model.state_dict()  # packed layouts are no checkpoint
    fused = saved["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], fused[:64])
    assert torch.equal(state["model.layers.0.self_attn.k_proj.weight"], fused[64:96])


def test_partial_rotary_bf16_speculation_is_plain_decoding(phi4):
    """bf16 on the native kernels where this CPU has them: drafts and batches change no token."""
    target = load_model(phi4, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    plain = [speculant_greedy(target, p) for p in PROMPTS]
    assert [speculant_greedy(target, p, {"method": "ngram", "num_speculative_tokens": 4}) for p in PROMPTS] == plain
    engine = Engine(target, None, 0, max_batch_size=len(PROMPTS), max_model_len=128)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    assert [s.output_ids for s in engine.generate(seqs)] == plain


def test_odd_rotary_dims_are_refused(phi3, tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(phi3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = cfg["partial_rotary_factor"] = 0.7  # 11.2 of 16 dims
    for name in ("short_factor", "long_factor"):  # one per pair of the 11 dims, as transformers checks
        rope[name] = rope[name][:5]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculantError, match="partial_rotary_factor 0.7 rotates 11 of 16"):
        load_model(folder)


def write_phi3_gguf(path, folder, qtype=None) -> None:
    """llama.cpp's layout of a Phi-3 folder: fused attn_qkv and ffn_up kept, LongRoPE's factors as tensors."""
    import gguf
    from test_gguf import add_weights, close, writer_for

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg.num_hidden_layers)
    writer = writer_for(path, "phi3", cfg, cfg.rope_parameters["rope_theta"])
    partial = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(cfg.hidden_size // cfg.num_attention_heads * partial))
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    add_weights(writer, model, names, qtype)
    rope = cfg.rope_parameters
    for kind in ("short", "long"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    close(writer)


@pytest.mark.parametrize("layout", [PHI3_LONGROPE, PHI4_MINI], ids=["phi3", "phi4-mini"])
def test_gguf_from_the_same_weights_matches_transformers(tmp_path, layout):
    from test_gguf import VOCAB

    folder = save_tiny(tmp_path / "phi3", transformers.Phi3Config, seed=5, init_std=0.1, pad_token_id=0,
                       vocab_size=VOCAB, **layout)
    path = tmp_path / "tiny-phi3.gguf"
    write_phi3_gguf(path, folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = ref(ids).logits
        target = load_model(path)  # float32: through the converted folder, fused tensors split there
        got = target.model.logits(target.model(ids, target.model.new_cache(1, 64), torch.tensor([0])))
    assert target.config.max_position_embeddings == 256
    assert (got - expected).abs().max().item() <= 1e-4
    for prompt in PROMPTS:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert speculant_greedy(target, prompt, {"method": "ngram", "num_speculative_tokens": 4}) == \
            out[0, len(prompt):].tolist()


def test_gguf_without_its_long_factors_is_refused(tmp_path):
    from speculant.models import gguf_file

    with pytest.raises(SpeculantError, match="needs both rope_factors_short and rope_factors_long"):
        gguf_file.longrope_scaling({"short_factor": [1.0]}, {"phi3.rope.scaling.original_context_length": 256}, "phi3",
                                   tmp_path / "x.gguf")


@pytest.mark.parametrize("layout", [PHI3_LONGROPE, PHI4_MINI], ids=["phi3", "phi4-mini"])
def test_gguf_on_its_own_blocks_speculates_exactly(tmp_path, layout):
    """Q8_0 blocks on the native kernels, the fused tensors as they are (Phi-4-mini's rows in the rotary layout):
    near the same file dequantized, and its speculative and batched output is its plain output alone."""
    import gguf
    from test_gguf import VOCAB, native_target

    folder = save_tiny(tmp_path / "phi3", transformers.Phi3Config, seed=5, init_std=0.1, pad_token_id=0,
                       vocab_size=VOCAB, **layout)
    path = tmp_path / "tiny-phi3-q8_0.gguf"
    write_phi3_gguf(path, folder, gguf.GGMLQuantizationType.Q8_0)
    target = native_target(path)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(6))
    expected = logits_of(load_model(path), ids)  # the same blocks dequantized, in fp32
    assert (logits_of(target, ids) - expected).abs().max().item() < 0.05 * expected.abs().max().item()
    plain = [speculant_greedy(target, p) for p in PROMPTS]
    assert [speculant_greedy(target, p, {"method": "ngram", "num_speculative_tokens": 4}) for p in PROMPTS] == plain
    engine = Engine(target, None, 0, max_batch_size=len(PROMPTS), max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    assert [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in PROMPTS])] == plain
