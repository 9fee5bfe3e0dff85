"""A projection's weights as the native kernels take them, whichever kernel its layer runs: what the whole-layer
calls (csrc/decoder.cpp, csrc/moe.cpp) read instead of calling the layer module."""

from __future__ import annotations

import torch
from torch import nn

from speculant.models.ggml import GGMLLinear
from speculant.models.kernels import PackedLinear
from speculant.models.quantize import Int4Linear


def native_projection(linear: nn.Module, bias_ok: bool = False) -> list[torch.Tensor] | None:
    """A projection's weights as the native layer takes them: ggml_mm's 7 tensors a part (GGUF blocks),
    (q, scale, minimum) for the int4 kernel, (w) for the AMX bf16 one; None for any other kernel, or a
    bias (but the qkv projection's, `bias_ok`, which decoder.cpp adds for GGUF blocks)."""
    if isinstance(linear, GGMLLinear) and (linear.bias is None or bias_ok):
        return linear.weights
    if isinstance(linear, Int4Linear) and linear.native and linear.bias is None:
        return [linear.weight, linear.scale, linear.minimum]
    if isinstance(linear, PackedLinear) and linear.kind == "amx" and linear.bias is None:
        return [linear.weight]
    return None
