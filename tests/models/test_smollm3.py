"""SmolLM3 against transformers: Llama with no RoPE on the layers `no_rope_layers` marks 0 (every fourth by
default), tied embeddings; from its folder and from a GGUF written with llama.cpp's names (q/k rows
interleaved as its Llama converter writes them; llama.cpp fixes the NoPE step at four). Speculation and batches
keep the output."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import greedy_tokens, reference_greedy_tokens, save_tiny, transformers
from test_gguf import VOCAB, close, llama_permute, native_target, writer_for

from speculant.models import llama
from speculant.models.loader import load_model

TOL = 1e-4
PROMPTS = [[5, 17, 33, 8, 60, 12, 99, 140, 7, 23], [40, 41, 42, 40, 41, 42, 40, 41], [90, 3, 77, 21, 14, 9, 55]]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=1000.0, pad_token_id=0)
IDS = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("smollm3") / "hf", transformers.SmolLM3Config, seed=0, init_std=0.1,
                     **SHAPE)


def reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Prefill 12, then one by one (each decoding step through the NoPE layer too)."""
    slot, cache = torch.tensor([0]), model.new_cache(1, 64)
    with torch.no_grad():
        got = [model.logits(model(ids[:, :12], cache, slot))]
        got += [model.logits(model(ids[:, t:t + 1], cache, slot)) for t in range(12, ids.shape[1])]
    return torch.cat(got, dim=1)


def test_config_reads_the_nope_layers(folder):
    cfg = load_model(folder).model.cfg
    assert cfg.nope_layers == (3,) and cfg.tie_embeddings


@pytest.mark.parametrize("mutant", [False, True])
def test_folder_matches_transformers(folder, mutant):
    """Logits within 1e-4; mutant: the NoPE layer rotated like the others, caught."""
    with torch.no_grad():
        expected = reference(folder)(IDS).logits
    model = load_model(folder).model
    if mutant:
        model.cfg.nope_layers = ()
    err = (logits(model, IDS) - expected).abs().max().item()
    assert err > 10 * TOL if mutant else err <= TOL


def test_greedy_and_speculation_equal_transformers(folder):
    ref = reference(folder)
    expected = [reference_greedy_tokens(ref, p) for p in PROMPTS]
    target = load_model(folder)
    assert greedy_tokens(target, PROMPTS) == expected
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert greedy_tokens(target, PROMPTS, ngram, max_batch_size=3) == expected
    draft = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    assert greedy_tokens(target, PROMPTS, draft, max_batch_size=3) == expected


def write_smollm3_gguf(path, folder, qtype=gguf.GGMLQuantizationType.F32):
    model = reference(folder)
    cfg = model.config
    writer = writer_for(path, "smollm3", cfg, cfg.rope_parameters["rope_theta"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.SMOLLM3, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        value = tensor.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            value = llama_permute(value, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    close(writer)
    return path


def test_gguf_matches_transformers(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = write_smollm3_gguf(tmp_path / "smollm3-f32.gguf", folder)
    ref = reference(folder)
    with torch.no_grad():
        expected = ref(IDS).logits
    target = load_model(path)
    assert target.model.cfg.nope_layers == (3,)
    assert (logits(target.model, IDS) - expected).abs().max().item() <= TOL
    assert greedy_tokens(target, PROMPTS) == [reference_greedy_tokens(ref, p) for p in PROMPTS]


def test_gguf_on_its_own_blocks_speculates_exactly(folder, tmp_path, monkeypatch):
    """Q8_0 blocks on the native kernels: the NoPE layer keeps the stack off the one-call native decoder
    (llama.native_layer_form), and speculative and batched output is the plain output."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = write_smollm3_gguf(tmp_path / "smollm3-q8.gguf", folder, gguf.GGMLQuantizationType.Q8_0)
    target = native_target(path)
    assert target.model.native_stack is None and llama.native_layer_form(target.model.cfg, 0)
    plain = [greedy_tokens(target, [p])[0] for p in PROMPTS]
    assert greedy_tokens(target, PROMPTS, max_batch_size=3) == plain
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert greedy_tokens(target, PROMPTS, ngram, max_batch_size=3) == plain
