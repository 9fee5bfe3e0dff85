"""Every linear layer on every CPU weight path gives a row the same bits whatever the number of rows in the call
and whatever the other rows: row r of an M-row call equals row r computed alone, bitwise, for M from 1 to 700,
as one prompt [1, M, K] and as a batch of single rows [M, 1, K]. Greedy output independent of the batch, and a
prefix cache whose keys equal a cold prefill's, rest on it.

Kinds: fp32 and fp16 (kernels.PackedLinear, transposed: f32_mm.cpp), bf16 (PackedLinear: AMX tiles or
bf16_dot.cpp, whichever this CPU and level run), int8 (quantize.Int8Linear, PyTorch's int8 kernel, with fp32
and bf16 activations), int4 (Int4Linear: quantized.cpp where it runs, PyTorch's int4 kernel forced as well),
the int4 model's Q8_0 head (Int8GroupLinear), GGUF blocks (ggml.GGMLLinear). Shapes: the tiny test models'
layers (tests/conftest.py) and SmolLM2-135M's by default, a 1.5B model's (Qwen2.5-1.5B: 1536 wide, MLP 8960)
in the slow suite. tests/models/test_lower_levels.py runs this file again at every kernel level below this CPU's.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from speculant.models import ggml, native
from speculant.models.kernels import PackedLinear
from speculant.models.quantize import Int4Linear, Int8GroupLinear, Int8Linear

ROWS = [1, 2, 5, 8, 31, 32, 33, 64, 300, 700]
# (out, in): the tiny target's qkv, o, gate_up, down and head, the draft's, a vocabulary of 8 over 16 inputs.
TINY = [(128, 64), (64, 64), (256, 64), (64, 128), (96, 64), (64, 32), (128, 32), (32, 64), (96, 32), (8, 16)]
SMOLLM = [(960, 576), (576, 1536)]
LARGE = [(1536, 1536), (8960, 1536), (1536, 8960)]
KINDS = ["fp32", "fp16", "bf16", "int8", "int8_bf16_rows", "int4", "int4_pytorch", "int8_groups", "gguf_q4_0",
         "gguf_q4_k", "gguf_q6_k"]
GGUF = {"gguf_q4_0": gguf.GGMLQuantizationType.Q4_0, "gguf_q4_k": gguf.GGMLQuantizationType.Q4_K,
        "gguf_q6_k": gguf.GGMLQuantizationType.Q6_K}


def random_blocks(qtype: gguf.GGMLQuantizationType, n_out: int, n_in: int, gen: torch.Generator) -> list:
    """Random valid blocks of a GGUF type (uniform bytes, small finite fp16 scales), in the kernel's layout."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n_out, n_in // block, size), dtype=torch.uint8, generator=gen)
    scales = {gguf.GGMLQuantizationType.Q4_0: [(0, 2)], gguf.GGMLQuantizationType.Q6_K: [(208, 210)],
              gguf.GGMLQuantizationType.Q4_K: [(0, 2), (2, 4)]}[qtype]
    for a, b in scales:
        d = (torch.rand(n_out, n_in // block, 1, generator=gen) * 0.01 / block).to(torch.float16)
        raw[:, :, a:b] = d.view(torch.uint8)
    blocks = ggml.decode(qtype, raw.reshape(n_out, -1).numpy(), n_out, n_in)
    return ggml.layout(blocks)


def make(kind: str, n_out: int, n_in: int, monkeypatch) -> tuple[nn.Module, torch.dtype]:
    """The layer of `kind` over random weights, and the dtype its inputs have in a model."""
    gen = torch.Generator().manual_seed(n_out * 7919 + n_in)
    linear = nn.Linear(n_in, n_out, bias=False)
    linear.weight.data = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5
    if kind in ("fp32", "fp16", "bf16"):
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kind]
        return PackedLinear(linear.to(dtype)), dtype
    if kind in ("int8", "int8_bf16_rows"):
        return Int8Linear(linear), torch.float32 if kind == "int8" else torch.bfloat16
    if kind in ("int4", "int4_pytorch") and (n_in % 32 or n_out % 16):
        pytest.skip("int4 takes groups of 32 inputs and blocks of 16 outputs (the layer stays 16-bit)")
    if kind == "int4_pytorch":
        monkeypatch.setattr(native, "quantized_usable", lambda out_features, in_features: False)
    if kind in ("int4", "int4_pytorch"):
        return Int4Linear(linear), torch.bfloat16
    if native.level() == "off":
        pytest.skip(native.off_reason())
    if kind == "int8_groups":
        if not native.quantized_usable(n_out, n_in):
            pytest.skip("the Q8_0 head's kernel does not take this shape at this level (the head stays 16-bit)")
        return Int8GroupLinear(linear), torch.bfloat16
    qtype = GGUF[kind]
    if not ggml.usable(qtype, n_out, n_in) or n_out % 16:
        pytest.skip(f"{qtype.name} blocks need inputs in multiples of {32 * ggml.FORMATS[qtype].superblock}")
    return ggml.GGMLLinear([random_blocks(qtype, n_out, n_in, gen)], n_in), torch.bfloat16


def check_rows(layer: nn.Module, dtype: torch.dtype, n_in: int, rows: list[int], seed: int = 0) -> None:
    """Each row of every call (M rows from row 0 and from row 37, as a prompt and as a batch) equals it alone."""
    if native.level() == "off":
        pytest.skip(native.off_reason() + ": PyTorch's kernels make no promise across row counts")
    gen = torch.Generator().manual_seed(seed)
    n = max(rows) + 37
    x = torch.randn(n, n_in, generator=gen).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[r:r + 1][None])[0] for r in range(n)])
        for m in rows:
            for start in (0, 37):
                part, want = x[start:start + m], alone[start:start + m]
                for shape, y in (("prompt", layer(part[None])[0]), ("batch", layer(part[:, None])[:, 0])):
                    differ = (y != want).any(-1).nonzero().flatten().tolist()
                    assert not differ, f"{m} rows from {start} as a {shape}: rows {differ[:10]} differ from alone"


@pytest.mark.parametrize("shape", TINY + SMOLLM, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_at_any_row_count(kind, shape, monkeypatch):
    n_out, n_in = shape
    layer, dtype = make(kind, n_out, n_in, monkeypatch)
    check_rows(layer, dtype, n_in, ROWS if shape in TINY else ROWS[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_at_any_row_count_on_a_1_5b_models_shapes(kind, shape, monkeypatch):
    n_out, n_in = shape
    layer, dtype = make(kind, n_out, n_in, monkeypatch)
    check_rows(layer, dtype, n_in, ROWS)


def test_thousands_of_rows_as_one_prompt():
    """A long prompt's rows against each row alone: 2560 inputs take the kernels' chunks of K (partial sums kept
    between them), 3000 rows many tiles, each thread its share of 208 outputs (a run of blocks cut short)."""
    for dtype in (torch.float32, torch.bfloat16):
        linear = nn.Linear(2560, 208, bias=True).to(dtype)
        check_rows(PackedLinear(linear), dtype, 2560, [3000])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_packed_linear_matches_the_plain_product(dtype):
    """Padding (a bf16 shape off the tiles' multiples), bias and 3-D inputs: the product is nn.Linear's, within
    the rounding of the dtype (the kernels sum in fp32)."""
    if native.level() == "off":
        pytest.skip(native.off_reason())
    gen = torch.Generator().manual_seed(0)
    for n_out, n_in in [(96, 64), (8, 16), (50, 40), (1000, 576)]:
        linear = nn.Linear(n_in, n_out, bias=True)
        linear.weight.data = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5
        linear = linear.to(dtype)
        packed = PackedLinear(linear)
        assert packed.kind == ("transposed" if dtype != torch.bfloat16 else "amx" if native.amx() else "dot")
        x = torch.randn(3, 7, n_in, generator=gen).to(dtype)
        with torch.no_grad():
            y = packed(x)
            ref = x.double() @ linear.weight.double().T + linear.bias.double()
        assert y.shape == (3, 7, n_out) and y.dtype == dtype
        tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert ((y.double() - ref).norm() / ref.norm()).item() < tolerance, (n_out, n_in)
