"""Linear layers stored the way the fastest kernel of their device and dtype reads them.

A verify pass multiplies T = k + 1 rows by every weight, and speculation pays only if that costs
about what one row costs. On CPUs the default fp32 kernel (MKL, y = x Wᵀ) slows sharply from
T = 4 on, while the same product with the weight stored transposed (y = x W', W' = Wᵀ
contiguous) stays flatter, and oneDNN's bf16 kernel with a prepacked weight (AMX where the CPU has
it) is flat up to T = 16 (docs/performance.md). The products are the same; only the
weight's memory layout and the kernel differ.
"""

from __future__ import annotations

import torch
from torch import nn

from speculant.models import native
from speculant.models.limits import MAX_VERIFY_WIDTH

ONEDNN_BATCH_HINT = 8  # the row count oneDNN lays the packed weight out for: a typical verify pass
# oneDNN's packed bf16 kernel gives a row the same bits whatever the row count up to 32 rows, other bits
# from 33 on (on every SmolLM2 layer shape): wider passes go in chunks of 32, unless they hold one
# sequence's prompt, computed the same way in every run (chunks would slow a prompt down).
ONEDNN_EXACT_ROWS = 32


def _onednn_usable(dtype: torch.dtype) -> bool:
    return (dtype in (torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bf16 matmuls run on dedicated hardware here (CUDA; on CPUs, AMX or AVX512-BF16 read
    from /proc/cpuinfo, which oneDNN's packed kernel uses)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not _onednn_usable(torch.bfloat16):
        return False
    flags = native.cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


class PackedLinear(nn.Module):
    """y = x Wᵀ + b (frozen, inference only) with W transposed (CPU fp32), in AMX tiles (CPU bf16 where the
    native kernel runs) or prepacked for oneDNN (other CPU bf16/fp16)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        if w.dtype == torch.float32:
            self.kind = "transposed"
            self.register_buffer("weight", w.t().contiguous())  # [in, out]
        elif w.dtype == torch.bfloat16 and native.bf16_usable(*w.shape):
            # Row-exact at any row count and faster than oneDNN's, for the layers and the head alike.
            self.kind = "amx"
            self.register_buffer("weight", native.bf16_layout(w))
        else:
            self.kind = "onednn"
            self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "amx":
            y = native.bf16_mm(x.reshape(-1, self.in_features), self.weight).unflatten(0, x.shape[:-1])
            return y if self.bias is None else y + self.bias
        if self.kind == "onednn":
            rows = x.flatten(0, -2)
            if rows.shape[0] <= ONEDNN_EXACT_ROWS or _one_prompt(x):
                return self._onednn(x)
            return torch.cat([self._onednn(c) for c in rows.split(ONEDNN_EXACT_ROWS)]).unflatten(0, x.shape[:-1])
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def _one_prompt(x: torch.Tensor) -> bool:
    """[1, T, D] wider than any verify pass: a single sequence's prompt."""
    return x.dim() == 3 and x.shape[0] == 1 and x.shape[1] > MAX_VERIFY_WIDTH


def packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight
    return w.device.type == "cpu" and (w.dtype == torch.float32 or _onednn_usable(w.dtype))


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace, in place, every plain nn.Linear that has a faster CPU layout (others stay as they are:
    CUDA's kernels take the weight as it is; quantized layers have their own kernel)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if packable(child):
                setattr(parent, name, PackedLinear(child))
    return model

