"""Gemma 2 against transformers: attention scores and final logits soft-capped (caps small enough here that capping
moves every result), a sliding window on the even layers, one RoPE base, query_pre_attn_scalar, sandwich norms,
GeGLU, (1 + w) norms with random weights, scaled and tied embeddings; from a Gemma2ForCausalLM folder and from a
GGUF file written from the same weights. The capped scores are checked on both attention paths (the native kernel
and PyTorch's, written out), and speculation and batches keep the output in fp32 and bf16."""

from __future__ import annotations

import gguf
import pytest
import torch
from conftest import save_tiny, transformers
from gguf import GGMLQuantizationType as Q
from test_gemma3 import our_logits, randomize_norms, run
from test_gguf import VOCAB, add_weights, close, native_target, windowed_writer

from speculant.models import attention, llama, model_config, native
from speculant.models import gguf as conv
from speculant.models.loader import load_model

TOL = 1e-4
WINDOW = 8
ATTN_CAP, FINAL_CAP = 5.0, 3.0
N_TOKENS = 32  # test_gemma3.run writes as many
PROMPTS = [[5, 17, 33, 8, 60, 12, 99, 140, 7, 23, 81, 64, 3, 200], [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
           [90, 3, 77, 21, 14, 9, 55, 31, 62, 250, 18, 6, 111, 47, 19, 33, 8]]
# Four layers, sliding and global in turn; head_dim set apart from hidden / heads and from the score scale.
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
            attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP, pad_token_id=0, init_std=0.1)
IDS = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def save_gemma2(path, seed: int = 0, **overrides):
    save_tiny(path, transformers.Gemma2Config, seed=seed, **{**TINY, **overrides})
    model = transformers.Gemma2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    randomize_norms(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return path


def reference(folder) -> torch.nn.Module:
    """transformers' model in fp32 on its eager attention (the one that caps scores)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(folder)(ids).logits


def transformers_greedy(folder, prompts: list[list[int]]) -> list[list[int]]:
    ref = reference(folder)
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_gemma2(tmp_path_factory.mktemp("gemma2") / "target")


@pytest.fixture(params=["native", "torch"])
def attention_path(request, monkeypatch) -> str:
    """The native attention kernel (fp32 and bf16 at head size 32), or PyTorch's path with the scores written out
    (where the kernel does not run: no AVX2, another head size, CUDA)."""
    if request.param == "native" and not native.attention_usable(TINY["head_dim"]):
        pytest.skip(f"the native attention kernel does not run here ({native.off_reason() or 'head size'})")
    if request.param == "torch":
        monkeypatch.setattr(llama, "native_attention_usable", lambda *a: False)
        monkeypatch.setattr(attention, "native_attention_usable", lambda *a: False)
    return request.param


def test_config_reads_the_caps_and_the_layer_pattern(folder):
    cfg = load_model(folder).model.cfg
    assert (cfg.attn_softcap, cfg.logit_softcap) == (ATTN_CAP, FINAL_CAP)
    assert [cfg.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert not cfg.qk_norm and cfg.local_rope_theta is None and cfg.query_scale == 24 ** -0.5
    # Gemma 2's own config.json files list no layer_types: transformers' default, even layers sliding.
    plain = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": VOCAB, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "sliding_window": 4096}
    cfg = model_config.ModelConfig.from_hf(plain)
    assert [cfg.kind(i) for i in range(6)] == [model_config.SLIDING, model_config.FULL] * 3
    # No caps stated: Gemma2Config's (50, 30), as transformers applies them; its head size 256 likewise.
    assert (cfg.attn_softcap, cfg.logit_softcap, cfg.head_dim) == (50.0, 30.0, 256)
    assert all(llama.native_layer_form(cfg, i) for i in range(6))  # caps, windows, GeGLU: the native layer's too


def test_logits_match_transformers_past_the_window(folder, attention_path):
    expected = reference_logits(folder, IDS)
    got, redo = our_logits(load_model(folder).model, IDS)
    err, err_redo = (got - expected).abs().max().item(), (redo - expected[:, -3:]).abs().max().item()
    print(f"gemma2 ({attention_path}): max |Δlogits| {err:.2e}, after rollback {err_redo:.2e}")
    assert err <= TOL and err_redo <= TOL
    assert expected.abs().max().item() < FINAL_CAP  # the final cap bounds them: it applied


@pytest.mark.parametrize("mutant", ["no_attention_cap", "no_final_cap", "window_plus_one"])
def test_each_gemma2_rule_is_needed(folder, attention_path, mutant):
    """Each rule dropped alone moves the logits past the tolerance, on either attention path: the comparison
    above has teeth."""
    expected = reference_logits(folder, IDS)
    model = load_model(folder).model
    if mutant == "no_attention_cap":
        model.cfg.attn_softcap = None
    elif mutant == "no_final_cap":
        model.cfg.logit_softcap = None
    else:
        model.cfg.sliding_window = WINDOW + 1
    got, _ = our_logits(model, IDS)
    assert (got - expected).abs().max().item() > 10 * TOL


def test_capped_attention_equals_transformers_eager(folder):
    """The written-out attention with an additive mask (a window's, as CUDA passes take it) against transformers'
    own eager function."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 12, 32, generator=gen) * 3 for h in (4, 2, 2))
    positions = torch.arange(12).expand(2, 12)
    mask = attention.attention_mask(positions, torch.zeros(2, dtype=torch.long), 12, WINDOW, torch.float32)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    expected, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.2, softcap=ATTN_CAP)
    got = attention.capped_attention(q, k, v, mask, enable_gqa=True, scale=0.2, softcap=ATTN_CAP)
    assert (got.transpose(1, 2) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_kernel_caps_as_pytorch(dtype):
    """The kernel's capped scores (a window, a draft tree) against the written-out attention over the same keys,
    in fp32."""
    if not native.attention_usable(32):
        pytest.skip(f"the native attention kernel does not run here ({native.off_reason() or 'head size'})")
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(1, 2, 20, 32, generator=gen).to(dt) for _ in range(2))
    q = (torch.randn(1, 4, 4, 32, generator=gen) * 4).to(dt)  # [B, T, Hq, D]: positions 16 .. 19
    parents = [[-1, 0, 0, 2]]
    _, bits = attention.tree_layout(parents)
    tree, n_keys = torch.tensor(bits), torch.arange(17, 21)[None]
    for window, tree_ in ((None, None), (WINDOW, None), (None, tree), (WINDOW, tree)):
        got = native.attention(q, keys, values, n_keys, tree_, window, 0.2, ATTN_CAP)
        depths = [[0, 1, 1, 2]] if tree_ is not None else [[0, 1, 2, 3]]
        bits_ = bits if tree_ is not None else [[(1 << (t + 1)) - 1 for t in range(4)]]
        rows = attention.tree_row_keys([16], [4], depths, bits_, window, torch.device("cpu"))[0]
        for t, seen in enumerate(rows):
            want = attention.capped_attention(q[:, t:t + 1].transpose(1, 2).float(), keys[:, :, seen].float(),
                                          values[:, :, seen].float(), enable_gqa=True, scale=0.2,
                                          softcap=ATTN_CAP).transpose(1, 2)
            # bf16: the kernel's fp32 sums, rounded once at the output.
            assert (got[:, t:t + 1].float() - want).abs().max().item() <= (1e-5 if dtype == "float32" else 1e-2)
        uncapped = native.attention(q, keys, values, n_keys, tree_, window, 0.2)
        assert (uncapped.float() - got.float()).abs().max().item() > 1e-2  # the cap moved them


def test_greedy_tokens_equal_transformers_generate(folder, attention_path):
    expected = transformers_greedy(folder, PROMPTS)
    target = load_model(folder)
    alone = [run(target, None, [p], rows=1)[0] for p in PROMPTS]
    assert alone == expected
    assert run(target, None, PROMPTS) == expected  # batched
    assert [run(target, SPEC, [p], rows=1)[0] for p in PROMPTS] == expected
    assert run(target, SPEC, PROMPTS) == expected


def test_bfloat16_speculation_and_batches_equal_plain(folder, attention_path):
    """bf16, the engine's default on a CPU: each row's speculative and batched output is its plain output alone,
    token for token, on the native kernel and on PyTorch's path."""
    target = load_model(folder, dtype="bfloat16")
    # A folder's 1 + w norms stay fp32 (RMSNorm.fp32) and the whole-stack decoder takes bf16 norms: the layers run
    # as modules, on the native products where the CPU has them.
    assert target.model.native_stack is None
    plain = [run(target, None, [p], rows=1)[0] for p in PROMPTS]
    assert run(target, None, PROMPTS) == plain
    assert [run(target, SPEC, [p], rows=1)[0] for p in PROMPTS] == plain
    assert run(target, SPEC, PROMPTS) == plain


# --- GGUF ---------------------------------------------------------------------------------------------------

def write_gemma2_gguf(path, folder, caps: bool = True, qtype: gguf.GGMLQuantizationType = Q.F32) -> None:
    """llama.cpp's layout of the folder's weights: its tensor names, norms holding 1 + w, matrices in `qtype`, the
    caps and window in its keys (`caps` False: left out, so the reader falls back on llama.cpp's defaults)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2, cfg.num_hidden_layers)
    writer = windowed_writer(path, "gemma2", cfg, cfg.rope_parameters["rope_theta"])
    if caps:
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_weights(writer, model, names, qtype, norm_offset=1.0)
    close(writer)


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    """llama.cpp scales the scores by head_dim (but at 27B): the folder does too."""
    return save_gemma2(tmp_path_factory.mktemp("gemma2_gguf") / "folder", seed=7, query_pre_attn_scalar=32)


def test_gguf_matches_transformers(gguf_folder, tmp_path):
    path = tmp_path / "tiny-gemma2-f32.gguf"
    write_gemma2_gguf(path, gguf_folder)
    target = load_model(path)  # float32: through the converted folder
    cfg = target.model.cfg
    assert (cfg.attn_softcap, cfg.logit_softcap) == (ATTN_CAP, FINAL_CAP)
    assert [cfg.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    got, redo = our_logits(target.model, IDS)
    expected = reference_logits(gguf_folder, IDS)
    assert (got - expected).abs().max().item() <= TOL
    assert (redo - expected[:, -3:]).abs().max().item() <= TOL
    assert run(target, None, PROMPTS) == transformers_greedy(gguf_folder, PROMPTS)


def test_gguf_without_caps_takes_llama_cpps_defaults(gguf_folder, tmp_path):
    path = tmp_path / "tiny-gemma2-nocaps.gguf"
    write_gemma2_gguf(path, gguf_folder, caps=False)
    config = conv.hf_config(conv.open_gguf(path), conv.read_metadata(conv.open_gguf(path)), "gemma2", path)
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["sliding_window"] == WINDOW and config["query_pre_attn_scalar"] == 32


def test_gguf_on_its_own_blocks_speculates_exactly(gguf_folder, tmp_path):
    """Q8_0 blocks on the native kernels (bf16 activations, the capped attention kernel, the head's blocks capped
    after): a model of its own, close to the reference, whose speculative and batched output is its plain output
    alone."""
    path = tmp_path / "tiny-gemma2-q8_0.gguf"
    write_gemma2_gguf(path, gguf_folder, qtype=Q.Q8_0)
    target = native_target(path)
    assert target.model.native_stack is not None  # every layer in the native decoder (test_native_families.py)
    got, _ = our_logits(target.model, IDS)
    expected = reference_logits(gguf_folder, IDS)
    assert (got - expected).abs().max().item() < 0.25 * expected.abs().max().item()
    assert got.abs().max().item() <= FINAL_CAP
    plain = [run(target, None, [p], rows=1)[0] for p in PROMPTS]
    assert run(target, None, PROMPTS) == plain
    assert run(target, SPEC, PROMPTS) == plain
