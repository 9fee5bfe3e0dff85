"""Linear layers stored the way the fastest kernel of their device and dtype reads them, and computed so
that a row gets the same bits whatever the other rows of the call and however many there are.

A verify pass multiplies T = k + 1 rows by every weight, a batch many such rows, a prompt hundreds: greedy
output independent of the batch, and a prefix cache whose keys equal a cold prefill's, need each row's
product to be the same bits in every one of these calls. On CPUs with the native kernels every kind here is
(tests/models/test_row_invariance.py): fp32 and fp16 weights stored transposed (W' = Wᵀ contiguous) go to
f32_mm.cpp, bf16 ones in AMX's tile layout to bf16_mm (AMX tiles, or vdpbf16ps where the CPU has no AMX:
bf16_dot.cpp), each output one chain of products in input order. PyTorch's kernels, which ran here before,
are not row-exact: MKL's fp32 product changed rows from 5 rows on, oneDNN's packed bf16 kernel from 2 rows
on (a 1.5B model's shapes). They remain where the native kernels do not run (no AVX2, no compiler,
SPECULANT_NATIVE=off), and on CUDA, whose kernels take the weight as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculant.models import native
from speculant.models.limits import MAX_VERIFY_WIDTH

# Without the native kernels, bf16 goes to oneDNN's packed kernel:
ONEDNN_BATCH_HINT = 8  # the row count oneDNN lays the packed weight out for: a typical verify pass
# it gives a row the same bits up to 32 rows on SmolLM2's shapes (not on a 1.5B model's: from 2 rows on), so
# wider passes go in chunks of 32, unless they hold one sequence's prompt (chunks would slow a prompt down).
ONEDNN_EXACT_ROWS = 32


def _onednn_usable(dtype: torch.dtype) -> bool:
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and native.torch_bf16_linear())


def bf16_linear_kernel(device: torch.device) -> bool:
    """Whether bf16 linear layers have a kernel of their own here (CUDA; on CPUs the native bf16 kernels, else
    oneDNN's where the CPU runs it): elsewhere they stay plain nn.Linear, on PyTorch's slow reference product."""
    return device.type != "cpu" or native.bf16_usable(16, 32) or _onednn_usable(torch.bfloat16)


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bf16 matmuls run on dedicated hardware here (CUDA; on CPUs, AMX or AVX512-BF16 read from
    /proc/cpuinfo, which the native bf16 kernels use, and oneDNN's where they do not run)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not bf16_linear_kernel(device):
        return False
    flags = native.cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


class PackedLinear(nn.Module):
    """y = x Wᵀ + b (frozen, inference only), `kind` the layout and kernel:
    - "transposed": fp32 or fp16 W' [in, out], on f32_mm.cpp (fp32 products; PyTorch's x @ W' without the
      native kernels);
    - "amx" (AMX tiles) and "dot" (vdpbf16ps, or FMAs below AVX512): bf16 in native.bf16_layout, outputs and
      inputs padded with zeros to its multiples of 16 and 32, which adds nothing to any sum;
    - "onednn": bf16 prepacked for oneDNN, where the native kernels do not run."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.native = native.f32_usable()
        if w.dtype in (torch.float32, torch.float16):
            self.kind = "transposed"
            self.register_buffer("weight", w.t().contiguous())  # [in, out]
        elif w.dtype == torch.bfloat16 and native.bf16_usable(16, 32):
            # Row-exact at any row count and faster than oneDNN's, for the layers and the head alike. Only
            # "amx" goes to llama's native decoder layer (decoder.cpp): the kind it was tested with.
            self.kind = "amx" if native.amx() else "dot"
            self.padded_in = -self.in_features % 32
            padded = F.pad(w, (0, self.padded_in, 0, -self.out_features % 16))
            self.register_buffer("weight", native.bf16_layout(padded))
        else:
            self.kind = "onednn"
            self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in ("amx", "dot"):
            rows = x.reshape(-1, self.in_features)
            if rows.dtype != torch.bfloat16:
                rows = rows.to(torch.bfloat16)
            if self.padded_in:
                rows = F.pad(rows, (0, self.padded_in))
            y = native.bf16_mm(rows, self.weight)
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features].contiguous()
            if y.dtype != x.dtype:  # a no-op .to() is still a dispatch
                y = y.to(x.dtype)
            y = y.unflatten(0, x.shape[:-1])
            return y if self.bias is None else y + self.bias
        if self.kind == "onednn":
            rows = x.flatten(0, -2)
            if rows.shape[0] <= ONEDNN_EXACT_ROWS or _one_prompt(x):
                return self._onednn(x)
            return torch.cat([self._onednn(c) for c in rows.split(ONEDNN_EXACT_ROWS)]).unflatten(0, x.shape[:-1])
        if self.native:
            rows = x.reshape(-1, self.in_features)
            y = native.f32_mm(rows if rows.dtype == torch.float32 else rows.float(), self.weight)
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
            y = y.unflatten(0, x.shape[:-1])
        else:
            y = x @ self.weight
        return y if self.bias is None else y + self.bias

    @property
    def row_exact(self) -> bool:
        """Whether a row's product is the same bits in any call (the native kernels; oneDNN's and MKL's are not)."""
        return self.kind in ("amx", "dot") or (self.kind == "transposed" and self.native)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def inexact_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why a position's keys and values may depend on the pass that computed them (a whole prompt, a chunk, a
    decode step), so that a prefix cache's would differ from a cold prefill's in the last bits; None where
    every kernel gives a row the same bits in any call (tests/models/test_row_invariance.py)."""
    if device.type != "cpu":
        return f"{device.type.upper()}'s prompt passes run blocked kernels, not row-exact ones"
    if native.level() == "off":
        return f"the native kernels do not run ({native.off_reason()}) and PyTorch's are not row-exact"
    for name, layer in model.named_modules():
        if type(layer) is nn.Linear or (isinstance(layer, PackedLinear) and not layer.row_exact):
            return f"{name} runs a library kernel that is not row-exact"
    return None


def _one_prompt(x: torch.Tensor) -> bool:
    """[1, T, D] wider than any verify pass: a single sequence's prompt."""
    return x.dim() == 3 and x.shape[0] == 1 and x.shape[1] > MAX_VERIFY_WIDTH


def packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight
    if w.device.type != "cpu":
        return False
    # fp16 has no oneDNN kernel on CPUs without AVX512-FP16 (it refused to pack on Zen 5): the transposed
    # layout takes it, on f32_mm or PyTorch's matmul.
    if w.dtype in (torch.float32, torch.float16):
        return True
    return w.dtype == torch.bfloat16 and bf16_linear_kernel(w.device)


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace, in place, every plain nn.Linear that has a faster CPU layout (others stay as they are:
    CUDA's kernels take the weight as it is; quantized layers have their own kernel)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if packable(child):
                setattr(parent, name, PackedLinear(child))
    return model



VECTOR_RUN = 64  # elements: a multiple of every CPU vector width PyTorch's elementwise loops use


def vectorized(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise op: exp, sigmoid, rsqrt, …) of x, every element through PyTorch's vector loop: a loop's
    tail runs a scalar version whose bits differ, and which elements fall in the tail changes with the tensor's
    size, so a small tensor of per-head gates would round differently in a verify pass than in a decode step."""
    n = x.numel()
    flat = F.pad(x.reshape(-1), (0, -n % VECTOR_RUN))
    return fn(flat)[:n].view(x.shape)
