"""Gemma 3 (text) against transformers: (1 + w) norms with random weights, sandwich norms, GeGLU, scaled
embeddings, five local layers with a sliding window and their own RoPE base to each global one; from a
Gemma3ForCausalLM folder, a Gemma3ForConditionalGeneration folder and GGUF files written from the same weights.
Speculation, batches and prefix-cache hits keep the output, the window included, on every weight path."""

from __future__ import annotations

import copy
import json
import shutil

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import transformers
from test_gguf import VOCAB, add_weights, close, native_target, windowed_writer
from test_prefix_cache import BUDGET, check_turns, engine_on

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.llm import engine_for
from speculant.models import llama, model_config, native
from speculant.models.loader import load_model

TOL = 1e-4
WINDOW = 8
N_TOKENS = 32
# Longer than the window, so the local layers drop keys the global ones keep.
PROMPTS = [[5, 17, 33, 8, 60, 12, 99, 140, 7, 23, 81, 64, 3, 200], [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
           [90, 3, 77, 21, 14, 9, 55, 31, 62, 250, 18, 6, 111, 47, 19, 33, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
# Seven layers: five local, one global (the sixth), one local; head_dim set apart from hidden / heads.
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, max_position_embeddings=512,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gemma3_config(**overrides) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**{**TINY, **overrides})


def randomize_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Gemma's norms start at 0 (a scale of exactly 1): random ones catch a missing or doubled offset."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.5


def save_gemma3(path, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(gemma3_config(initializer_range=0.1, **overrides)).eval()
    randomize_norms(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma3")
    scaled = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
    return {
        # The scores' scale from query_pre_attn_scalar, not head_dim; the global layer's RoPE stretched 4×.
        "target": save_gemma3(root / "target", seed=0, query_pre_attn_scalar=24, rope_parameters=scaled),
        "draft": save_gemma3(root / "draft", seed=1, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                             head_dim=16, layer_types=["sliding_attention", "full_attention"]),
        # Head size 64: the native attention kernel's, for the bf16 paths.
        "wide": save_gemma3(root / "wide", seed=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=64, intermediate_size=256),
    }


def reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids).logits


def our_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill 16, decode one by one to the end, then roll 3 back and decode them again as one pass."""
    slot, n = torch.tensor([0]), ids.shape[1]
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        got = [model.logits(model(ids[:, :16], cache, slot))]
        got += [model.logits(model(ids[:, t:t + 1], cache, slot)) for t in range(16, n)]
        cache.rollback(0, n - 3)
        redo = model.logits(model(ids[:, n - 3:], cache, slot))
    return torch.cat(got, dim=1), redo


IDS = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers_past_the_window(folders):
    expected = reference_logits(folders["target"], IDS)
    model = load_model(folders["target"]).model
    assert model.cfg.attention_kinds == [model_config.FULL, model_config.SLIDING]
    got, redo = our_logits(model, IDS)
    err, err_redo = (got - expected).abs().max().item(), (redo - expected[:, -3:]).abs().max().item()
    print(f"gemma3: max |Δlogits| {err:.2e}, after rollback {err_redo:.2e}")
    assert err <= TOL and err_redo <= TOL


@pytest.mark.parametrize("mutant", ["window_plus_one", "window_minus_one", "no_norm_offset", "global_base_local"])
def test_each_gemma3_rule_is_needed(folders, monkeypatch, mutant):
    """Each rule broken alone moves the logits past the tolerance: the comparison above has teeth."""
    expected = reference_logits(folders["target"], IDS)
    if mutant == "no_norm_offset":  # the checkpoint's w used as the scale, not 1 + w
        monkeypatch.setattr(llama, "fold_offset_on_load", lambda norm, offset: None)
    model = load_model(folders["target"]).model
    if mutant.startswith("window"):
        model.cfg.sliding_window = WINDOW + (1 if mutant == "window_plus_one" else -1)
    if mutant == "global_base_local":
        model.cfg.local_rope_theta = model.cfg.rope_theta
        model.set_rope_frequencies()
    got, _ = our_logits(model, IDS)
    assert (got - expected).abs().max().item() > 10 * TOL


def test_conditional_generation_folder_loads_its_text_model(tmp_path):
    """A multimodal checkpoint: the text model under `model.language_model.`, the vision tower left unread."""
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=gemma3_config(initializer_range=0.1).to_dict(),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=5)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_norms(model, torch.Generator().manual_seed(3))
    model.save_pretrained(tmp_path / "mm")
    ids = torch.randint(6, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))  # no image tokens
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    ours = load_model(tmp_path / "mm").model
    got, _ = our_logits(ours, ids)
    assert (got - expected).abs().max().item() <= TOL


def test_multimodal_folder_with_a_sparse_text_config(tmp_path):
    """A text_config as Google publishes it: only what differs from Gemma3TextConfig's defaults, so the heads (8),
    KV heads (4), head size (256), RoPE bases (1M global, 10k local), score scale and layer pattern are the
    family's. The folder loads and gives the logits transformers gives from the same folder."""
    sparse = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
              "vocab_size": VOCAB, "sliding_window": WINDOW, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": sparse,
           "vision_config": vision, "mm_tokens_per_image": 4, "image_token_index": 5, "eos_token_id": [1, 106]}
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(**copy.deepcopy(raw)))
    randomize_norms(model, torch.Generator().manual_seed(5))
    model.save_pretrained(tmp_path / "mm")
    (tmp_path / "mm" / "config.json").write_text(json.dumps(raw))  # as published, whatever save_pretrained wrote
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.float32).eval()
    ids = torch.randint(6, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))  # no image tokens
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    ours = load_model(tmp_path / "mm").model
    c = ours.cfg
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta, c.local_rope_theta) == (8, 4, 256, 1e6, 1e4)
    got, _ = our_logits(ours, ids)
    assert (got - expected).abs().max().item() <= TOL


def bf16_checkpoint(folder, to):
    """The folder with its weights stored in bf16, as Gemma's are published."""
    shutil.copytree(folder, to)
    weights = safetensors.torch.load_file(to / "model.safetensors")
    safetensors.torch.save_file({k: v.bfloat16() for k, v in weights.items()}, to / "model.safetensors",
                                metadata={"format": "pt"})
    return to


@pytest.mark.parametrize("mutant", [False, True])
def test_bf16_model_keeps_the_folded_norm_scale_in_fp32(folders, tmp_path, monkeypatch, mutant):
    """A bf16 model's norms hold 1 + w exactly (fp32), and scale as transformers' Gemma3RMSNorm does, bit for
    bit: transformers adds the 1 in fp32 each pass. Mutant: the sum cast to bf16 with the rest of the model."""
    if mutant:
        monkeypatch.setattr(llama.RMSNorm, "_apply", torch.nn.Module._apply)
    folder = bf16_checkpoint(folders["wide"], tmp_path / "bf16")
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    model = load_model(folder, dtype="bfloat16").model
    assert model.dtype == torch.bfloat16
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    exact = [p.dtype == torch.float32 and torch.equal(p, stored[n].float() + 1) for n, p in norms.items()]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(128, eps=1e-6).to(torch.bfloat16)
    ref.weight.data.copy_(stored["model.norm.weight"])
    same = torch.equal(model.model.norm(x), ref(x))
    if mutant:
        assert not all(exact) and not same
    else:
        assert len(norms) == 4 * 7 + 2 * 7 + 1 and all(exact) and same


def run(target, spec: dict | None, prompts, rows: int = 4) -> list[list[int]]:
    engine = engine_for(target, SpeculativeConfig.parse(spec), rows, 128)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.generate(seqs)
    return [s.output_ids for s in seqs]


def transformers_greedy(folder, prompt: list[int]) -> list[int]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # no end token: every request writes N_TOKENS (ignore_eos in GREEDY)
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


def specs(folders) -> dict[str, dict]:
    draft = str(folders["draft"])
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
            "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
            "draft_tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "tree_width": 3}}


def test_greedy_tokens_equal_transformers_generate(folders):
    expected = [transformers_greedy(folders["target"], p) for p in PROMPTS]
    target = load_model(folders["target"])
    assert run(target, None, PROMPTS[:1], rows=1) == expected[:1]
    assert run(target, None, PROMPTS) == expected
    for name, spec in specs(folders).items():
        alone = [run(target, spec, [p], rows=1)[0] for p in PROMPTS]
        assert alone == expected, name
        assert run(target, spec, PROMPTS) == expected, name


@pytest.mark.parametrize("dtype", ["bfloat16", "int4"])
def test_speculation_and_batches_keep_each_weight_path_exact(folders, dtype):
    """bf16 on the native attention kernel with its window (head size 64), and int4 weights: another model
    each, whose speculative and batched output is its own plain output alone."""
    if dtype == "bfloat16" and not native.attention_usable(64):
        pytest.skip("the native attention kernel does not run here (no AVX2, or no compiler)")
    kwargs = {"dtype": "bfloat16"} if dtype == "bfloat16" else {"quantization": "int4"}
    target = load_model(folders["wide"], **kwargs)
    plain = [run(target, None, [p], rows=1)[0] for p in PROMPTS]
    assert run(target, None, PROMPTS) == plain
    for name, spec in specs(folders).items():
        assert run(target, spec, PROMPTS) == plain, name


def test_bfloat16_verify_pass_equals_single_steps_bitwise(folders):
    """A k+1-wide pass through the local layers gives each position the bits a one-token step gives it,
    where the window has dropped keys and where it has not yet."""
    if not native.attention_usable(64):
        pytest.skip("the native attention kernel does not run here (no AVX2, or no compiler)")
    model = load_model(folders["wide"], dtype="bfloat16").model
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    slot = torch.tensor([0])
    for prefix in (4, 9, 30):
        with torch.no_grad():
            cache = model.new_cache(1, 48)
            model(ids[:, :prefix], cache, slot)
            single = torch.cat([model.logits(model(ids[:, t:t + 1], cache, slot))
                                for t in range(prefix, prefix + 6)], 1)
            cache.rollback(0, prefix)
            wide = model.logits(model(ids[:, prefix:prefix + 6], cache, slot))
        assert torch.equal(single, wide), prefix


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_cache_hit_equals_cold(folders, dtype):
    target = load_model(folders["wide" if dtype == "bfloat16" else "target"], dtype=dtype)
    check_turns(target, engine_on(target, BUDGET, chunk=7), GREEDY)


# --- GGUF ---------------------------------------------------------------------------------------------------

def write_gemma3_gguf(path, folder, qtype: gguf.GGMLQuantizationType) -> None:
    """llama.cpp's layout of the folder's weights: its tensor names, norms holding 1 + w, matrices in `qtype`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    writer = windowed_writer(path, "gemma3", cfg, cfg.rope_parameters["full_attention"]["rope_theta"])
    add_weights(writer, model, names, qtype, norm_offset=1.0)
    close(writer)


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    """llama.cpp fixes the scores' scale to head_dim and the local RoPE base to 10,000: the folder does too."""
    root = tmp_path_factory.mktemp("gemma3_gguf")
    return save_gemma3(root / "folder", seed=7, query_pre_attn_scalar=TINY["head_dim"])


def test_gguf_matches_transformers(gguf_folder, tmp_path):
    path = tmp_path / "tiny-gemma3-f32.gguf"
    write_gemma3_gguf(path, gguf_folder, gguf.GGMLQuantizationType.F32)
    expected = reference_logits(gguf_folder, IDS)
    model = load_model(path).model  # float32: through the converted folder
    got, redo = our_logits(model, IDS)
    assert (got - expected).abs().max().item() <= TOL
    assert (redo - expected[:, -3:]).abs().max().item() <= TOL
    assert run(load_model(path), None, PROMPTS) == [transformers_greedy(gguf_folder, p) for p in PROMPTS]


def test_gguf_on_its_own_blocks_speculates_exactly(gguf_folder, tmp_path):
    """Q8_0 blocks on the native kernels (bf16 activations): a model of its own, close to the reference, whose
    speculative and batched output is its plain output alone."""
    path = tmp_path / "tiny-gemma3-q8_0.gguf"
    write_gemma3_gguf(path, gguf_folder, gguf.GGMLQuantizationType.Q8_0)
    target = native_target(path)
    assert target.model.native_stack is not None  # every layer in the native decoder (test_native_families.py)
    got, _ = our_logits(target.model, IDS)
    expected = reference_logits(gguf_folder, IDS)
    assert (got - expected).abs().max().item() < 0.25 * expected.abs().max().item()
    plain = [run(target, None, [p], rows=1)[0] for p in PROMPTS]
    assert run(target, None, PROMPTS) == plain
    assert run(target, {"method": "ngram", "num_speculative_tokens": 4}, PROMPTS) == plain
    draft = {"method": "draft_model", "model": str(gguf_folder), "num_speculative_tokens": 3}
    assert run(target, draft, PROMPTS) == plain
    check_turns(target, engine_on(target, BUDGET, chunk=7), GREEDY)


def test_gguf_norms_without_the_offset_are_caught(gguf_folder, tmp_path, monkeypatch):
    """A reader that forgot llama.cpp's +1 in the norms (or added it twice) is off: the test above can fail."""
    from speculant.models import gguf as conv

    path = tmp_path / "tiny-gemma3-f32.gguf"
    write_gemma3_gguf(path, gguf_folder, gguf.GGMLQuantizationType.F32)
    real = conv.hf_config
    monkeypatch.setattr(conv, "hf_config", lambda *a: {k: v for k, v in real(*a).items()
                                                       if k != "norm_weights_include_offset"})
    got, _ = our_logits(load_model(path).model, IDS)
    assert (got - reference_logits(gguf_folder, IDS)).abs().max().item() > 10 * TOL


def test_gguf_conversion_and_native_constants():
    """Constants llama.cpp fixes for the family: five local layers to one global, the local base 10,000."""
    cfg = model_config.ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3",
                                     **{k: v for k, v in TINY.items()}, "num_hidden_layers": 12,
                                     "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                                     "rope_theta": 1e6, "rms_norm_eps": 1e-6})
    assert [cfg.kind(i) for i in range(12)] == ([model_config.SLIDING] * 5 + [model_config.FULL]) * 2
    assert cfg.local_rope_theta == 10000.0 and cfg.window(0) == WINDOW and cfg.window(5) is None
    assert np.isclose(cfg.rope_theta, 1e6)
