"""The native whole-stack decoder (csrc/decoder.cpp) on every family's layer form, from GGUF blocks: Gemma 3 (q/k
norms, sandwich norms, GeGLU, scaled embeddings, local layers with a window and their own RoPE, a score scale),
Gemma 2 (soft-capped scores) and Phi-3 (fused tensors, LongRoPE, partial rotary as Phi-4-mini's, a window on every
layer). It must give the bits the
layer modules give (the path it replaces, on the same kernels): prefill, one token, a verify pass and a ragged batch,
past the window; and each rule dropped from the native layer alone must change them."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from conftest import save_tiny, transformers
from test_gemma2 import save_gemma2, write_gemma2_gguf
from test_gemma3 import save_gemma3, write_gemma3_gguf
from test_gguf import VOCAB, native_target
from test_phi3 import write_phi3_gguf

from speculant.models import native

Q8_0 = gguf.GGMLQuantizationType.Q8_0
WINDOW = 8  # the three files' own
# llama.cpp's Gemma files all scale the scores by head_dim: another scale, set before any pass, shows that the native
# layer reads it.
QUERY_SCALE = {"gemma3": 0.15}
# Phi-4-mini's layout (3/4 of each head rotates, LongRoPE) at the native attention kernel's smallest head, 32.
PHI4_MINI_32 = dict(hidden_size=128, max_position_embeddings=1024, original_max_position_embeddings=256,
                    partial_rotary_factor=0.75, rope_scaling={"type": "longrope",
                                                              "short_factor": [1.0 + 0.1 * i for i in range(12)],
                                                              "long_factor": [2.0 + 0.2 * i for i in range(12)]})


def write_file(family: str, root) -> object:
    """A tiny Q8_0 GGUF file of `family` with random weights and norms."""
    path = root / f"tiny-{family}-q8_0.gguf"
    if family == "gemma3":
        write_gemma3_gguf(path, save_gemma3(root / "folder", seed=7, query_pre_attn_scalar=32), Q8_0)
    elif family == "gemma2":
        write_gemma2_gguf(path, save_gemma2(root / "folder", seed=7, query_pre_attn_scalar=32), qtype=Q8_0)
    else:
        write_phi3_gguf(path, save_tiny(root / "folder", transformers.Phi3Config, seed=5, init_std=0.1, pad_token_id=0,
                                        vocab_size=VOCAB, sliding_window=WINDOW, **PHI4_MINI_32), Q8_0)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family → its file, written on first use."""
    written = {}

    def file_of(family: str):
        if family not in written:
            written[family] = write_file(family, tmp_path_factory.mktemp(family))
        return written[family]
    return file_of


def load(path, query_scale: float | None = None):
    """The file on its own blocks, with `query_scale` where given."""
    model = native_target(path).model
    if query_scale is not None:
        model.cfg.query_scale = query_scale
    return model


def passes(model) -> tuple[list[torch.Tensor], object]:
    """Prompts past the window into rows out of order, then one token, a verify pass of 5 and a ragged pass of
    three rows → (the logits of each, the cache)."""
    gen = torch.Generator().manual_seed(0)
    # The first prompt wider than a verify pass (the stack's forward), the others decode's.
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (40, 9, 14)]
    steps = [torch.randint(3, VOCAB, (len(prompts), t), generator=gen) for t in (1, 5, 3)]
    cache, slots = model.new_cache(4, 64), torch.tensor([2, 0, 3])
    out = []
    with torch.no_grad():
        for slot, p in zip(slots, prompts):
            out.append(model.logits(model(p[None], cache, slot[None])))
        out.append(model.logits(model(steps[0][:1], cache, slots[:1])))
        out.append(model.logits(model(steps[1][:1], cache, slots[:1])))
        ragged = model.logits(model(steps[2], cache, slots, torch.tensor([3, 1, 2])))
    real = torch.arange(3) < torch.tensor([3, 1, 2])[:, None]  # the ragged pass's padding is nobody's output
    return out + [ragged[real]], cache


def module_passes(model, monkeypatch) -> tuple[list[torch.Tensor], object]:
    with monkeypatch.context() as m:
        m.setattr(model, "native_stack", None)
        return passes(model)


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "phi3"])
def test_native_stack_gives_the_bits_of_the_layer_modules(files, monkeypatch, family):
    model = load(files(family), query_scale=QUERY_SCALE.get(family))
    assert model.native_stack is not None and model.native_decode
    fused, fused_cache = passes(model)
    modules, module_cache = module_passes(model, monkeypatch)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b), f"max |Δ| {(a - b).abs().max():.3g}"
    assert torch.equal(fused_cache.lengths, module_cache.lengths)
    for slot, n in enumerate(fused_cache.lengths.tolist()):  # past a row's length lie padding keys, never read
        assert torch.equal(fused_cache.k[:, slot, :, :n], module_cache.k[:, slot, :, :n])


# Each rule of a family's layer broken alone in the native layers (decoder.cpp's Layer groups and Form).
MUTANTS = {
    "gemma3": {
        "no_qk_norms": lambda layer: with_groups(layer, 7, []),
        "no_sandwich_norms": lambda layer: with_groups(layer, 8, []),
        "silu_for_gelu": lambda layer: with_form(layer, 3, False),
        "global_rope_on_local_layers": lambda layer: with_form(layer, 4, False),
        "window_plus_one": lambda layer: with_form(layer, 0, layer.form[0] and layer.form[0] + 1),
        "default_score_scale": lambda layer: with_form(layer, 1, 0.0),
        "unscaled_embeddings": None,  # the stack's embed_scale, not a layer's
    },
    "gemma2": {
        "no_attention_cap": lambda layer: with_form(layer, 2, 0.0),
        "window_minus_one": lambda layer: with_form(layer, 0, layer.form[0] and layer.form[0] - 1),
    },
    "phi3": {
        "no_window": lambda layer: with_form(layer, 0, 0),
    },
}


def with_groups(layer: native.NativeLayer, i: int, group: list) -> native.NativeLayer:
    return dataclasses.replace(layer, groups=[group if j == i else g for j, g in enumerate(layer.groups)])


def with_form(layer: native.NativeLayer, i: int, value) -> native.NativeLayer:
    return dataclasses.replace(layer, form=tuple(value if j == i else f for j, f in enumerate(layer.form)))


@pytest.mark.parametrize("family,mutant", [(f, m) for f, mutants in MUTANTS.items() for m in mutants])
def test_each_rule_of_the_native_layer_is_needed(files, monkeypatch, family, mutant):
    model = load(files(family), query_scale=QUERY_SCALE.get(family))
    modules, _ = module_passes(model, monkeypatch)
    layers = [block.native_weights for block in model.model.layers]
    change = MUTANTS[family][mutant] or (lambda layer: layer)
    mutated = [change(layer) for layer in layers]
    shape = lambda layer: (layer.form, [len(g) for g in layer.groups])  # noqa: E731
    scale = 0.0 if mutant == "unscaled_embeddings" else model.embed_scale
    assert mutant == "unscaled_embeddings" or any(shape(a) != shape(b) for a, b in zip(mutated, layers))
    stack = native.decoder_stack(mutated, model.model.norm.weight, model.cfg.n_heads, model.cfg.n_kv_heads, scale)
    monkeypatch.setattr(model, "native_stack", stack)
    fused, _ = passes(model)
    assert any(not torch.equal(a, b) for a, b in zip(fused, modules))
