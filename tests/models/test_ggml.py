"""GGUF's block formats repacked for the native kernel (models/ggml.py, csrc/ggml_mm.cpp): every stored weight
equals gguf's dequantized value, the product is within bf16 rounding of the float product of those weights
and the int8 activations the kernel reads, and a row gets the same bits at any row count."""

import gguf
import numpy as np
import pytest
import torch

from speculant.models import ggml, native

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def quantized(qtype: T, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Random weights quantized by gguf's own quantizer where it has one, else random valid blocks."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
        scales = {T.Q6_K: [(208, 210)], T.Q4_K: [(0, 2), (2, 4)], T.Q5_K: [(0, 2), (2, 4)]}[qtype]
        for a, b in scales:  # finite, small fp16 scales (random bytes can be NaN or huge)
            raw[:, :, a:b] = (rng.random((n_out, n_in // block, 1)) * 0.01).astype(np.float16).view(np.uint8)
        return raw.reshape(n_out, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_repacked_weight_equals_ggufs_dequantized_value(qtype):
    raw = quantized(qtype, 32, 512)
    want = gguf.quants.dequantize(raw, qtype)
    got = ggml.decode(qtype, raw, 32, 512).dequantize()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def unpack(weights: list[torch.Tensor], n_out: int, n_in: int) -> torch.Tensor:
    """The kernel's layout read back into u [N, K] (the inverse of ggml.layout's planes)."""
    low, high, fmt = weights[0], weights[1], weights[6]
    bits = int(fmt[0])
    G = n_in // 32
    if bits == 8:
        v = low.view(n_out // 16, G, 8, 16, 4)
    else:
        nib = low.view(n_out // 16, G, 4, 16, 4).to(torch.int32)
        v = torch.cat((nib & 15, nib >> 4), 2)
        if bits == 5:
            h = high.view(n_out // 16, G, 16, 4).to(torch.int32)
            v = v | torch.stack([((h >> k) & 1) << 4 for k in range(8)], 2)
        elif bits == 6:
            h = high.view(n_out // 16, G, 2, 16, 4).to(torch.int32)
            v = v | torch.stack([((h[:, :, k // 4] >> (2 * (k % 4))) & 3) << 4 for k in range(8)], 2)
    return v.permute(0, 3, 1, 2, 4).reshape(n_out, n_in).to(torch.uint8)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_layout_keeps_every_stored_value(qtype):
    raw = quantized(qtype, 48, 512, seed=1)
    blocks = ggml.decode(qtype, raw, 48, 512)
    assert torch.equal(unpack(ggml.layout(blocks), 48, 512), torch.from_numpy(blocks.u))


def q8_activations(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """x as the kernel reads it: per `span` inputs (a K-quant's superblock of 256, else 32), dx·round(x/dx)."""
    groups = x.double().view(x.shape[0], -1, span)
    dx = groups.abs().amax(-1, keepdim=True).float().double() / 127
    return torch.where(dx > 0, torch.round(groups / dx) * dx, 0.0).view(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernel_gives_every_row_the_same_bits_at_any_row_count(qtype):
    if native.level() == "off":
        pytest.skip(native.off_reason())
    n_out, n_in = 80, 512  # 5 blocks of 16: a thread's share is odd, so both block pairings run
    raw = quantized(qtype, n_out, n_in, seed=2)
    blocks = ggml.decode(qtype, raw, n_out, n_in)
    weights = ggml.layout(blocks)
    w = torch.from_numpy(blocks.dequantize()).double()
    x = torch.randn(20, n_in, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[3, 64:96] = 0  # a group of zeros: scale 0
    y = native.ggml_mm(x, weights)
    ref = q8_activations(x, 32 * blocks.fmt.superblock) @ w.T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.004
    for rows in range(1, 21):
        assert torch.equal(native.ggml_mm(x[:rows], weights), y[:rows]), rows
    assert torch.equal(native.ggml_mm(x[7:8], weights), y[7:8])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("extreme", ["top", "bottom"])
def test_the_largest_integer_sums_do_not_overflow(qtype, extreme):
    """Every stored value at its end of the range and every activation at ±127: the integer sums at their
    largest (AVX2 without VNNI sums byte pairs in 16 bits, several vectors before widening)."""
    if native.level() == "off":
        pytest.skip(native.off_reason())
    n_out, n_in = 32, 512
    blocks = ggml.decode(qtype, quantized(qtype, n_out, n_in, seed=3), n_out, n_in)
    blocks.u[:] = (1 << blocks.fmt.bits) - 1 if extreme == "top" else 0
    w = torch.from_numpy(blocks.dequantize()).double()
    x = torch.ones(3, n_in).bfloat16()
    x[1] = -1
    x[2, ::2] = -1  # signs alternate within each byte pair
    y = native.ggml_mm(x, ggml.layout(blocks))
    ref = q8_activations(x, 32 * blocks.fmt.superblock) @ w.T
    assert ((y.double() - ref).abs() <= 0.008 * ref.abs() + 1e-3 * ref.abs().max()).all()


def test_parts_of_other_formats_write_side_by_side():
    """A fused qkv whose v is stored in other bits: each part's columns as if it ran alone."""
    if native.level() == "off":
        pytest.skip(native.off_reason())
    parts = [ggml.layout(ggml.decode(t, quantized(t, 32, 256, seed=i), 32, 256))
             for i, t in enumerate((T.Q4_K, T.Q6_K, T.Q8_0))]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    fused = native.ggml_mm(x, [t for p in parts for t in p])
    assert torch.equal(fused, torch.cat([native.ggml_mm(x, p) for p in parts], 1))


NATIVE_TYPES = {"attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q5_0, "ffn_up": T.Q4_1, "output": T.Q8_0}


def native_gguf(tmp_path, arch: str):
    """A tiny GGUF file whose every matrix has a native kernel (test_gguf.write_gguf's, with its float ones
    stored quantized)."""
    from test_gguf import LAYERS, write_gguf

    override = {f"blk.{i}.{kind}.weight": t for i in range(LAYERS) for kind, t in NATIVE_TYPES.items()}
    override["output.weight"] = T.Q8_0
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, override_type=override)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_file_loads_into_the_kernels_and_scores_as_its_dequantized_model(tmp_path, monkeypatch, arch):
    """Independent reference: a plain PyTorch model of the same dequantized weights (models/gguf.py's fp32
    folder). The native model differs by its int8 activations and bf16 rounding only. The packed cache is
    used on the second load and gives the same bits, read into huge pages or mapped from the file."""
    from speculant.models.hugepages import SWITCH_ENV, huge_pages_available
    from speculant.models.loader import load_model

    if native.level() == "off":
        pytest.skip(native.off_reason())
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = native_gguf(tmp_path, arch)
    first = load_model(path, dtype="bfloat16", quantization="auto")
    assert first.load_info.get("weights") == "gguf blocks" and not first.load_info["gguf_cached"]
    assert first.model.native_stack is not None
    reference = load_model(path, dtype="float32", quantization="none").model
    bf16_reference = load_model(path, dtype="bfloat16", quantization="none").model
    tokens = torch.tensor([[5, 17, 33, 2, 40, 41, 7, 9]])

    def logits(model):
        cache = model.new_cache(1, 64)
        with torch.no_grad():
            return model.logits(model(tokens, cache, torch.tensor([0]))).double()

    def error(model) -> float:
        return ((logits(model) - want).norm() / want.norm()).item()

    want, got = logits(reference), logits(first.model)
    # This random model amplifies rounding: PyTorch in bf16 is itself ~2% off; a wrong permutation, bias or
    # norm would be ~100%. The int8 activations may add as much again as bf16 does.
    assert error(first.model) < 2.5 * error(bf16_reference) < 0.1
    assert (first.load_info["huge_pages_bytes"] > 0) == huge_pages_available()
    monkeypatch.setenv(SWITCH_ENV, "off")
    again = load_model(path, dtype="bfloat16", quantization="auto")
    assert again.load_info["gguf_cached"] and again.load_info["huge_pages_bytes"] == 0
    assert torch.equal(logits(again.model), got)


def test_speculative_greedy_output_equals_plain_on_a_native_gguf_model(tmp_path, monkeypatch):
    """One by one and in a ragged batch, with prompt lookup and with a draft model (the file itself)."""
    from test_greedy_lossless import run

    from speculant.models.loader import load_model

    if native.level() == "off":
        pytest.skip(native.off_reason())
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = native_gguf(tmp_path, "qwen2")
    target = load_model(path, dtype="bfloat16", quantization="auto")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43], [9]]
    plain = run(target, None, prompts)[0]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}):
        batched, engine = run(target, spec, prompts)
        assert batched == plain
        assert [run(target, spec, [p], max_batch_size=1)[0][0] for p in prompts] == plain
        assert engine.stats.num_draft_tokens > 0
