"""Weight-only quantization of a model's linear layers: int8 (per output channel, symmetric) and
int4 (groups of 32 input weights, each with its own scale and minimum, CPU; the lm_head then int8 in
groups of 32 with a scale each, where the AMX kernel runs).

Decoding at batch 1 streams every weight once per pass: int8 weights are a quarter of fp32's
bytes, int4 an eighth. The quantized model is a different target: its speculative output equals
its own plain output, not the fp32 model's. Both CPU kernels give every row the same result
whatever the number of rows, so a verify pass scores like plain decoding.

int4 stores the weight as llama.cpp's Q4_1 does (w = d·q + m, q in 0..15, per 32 weights): a model
read from a Q4_1 GGUF file comes back on its own grid, so the int4 target is the file's weights
(scales rounded to bf16). Where the AMX kernel runs, int4 products and the int8 lm_head read the
activations as int8 per 32 (csrc/quantized.cpp), as llama.cpp's Q4_1 and Q8_0 products do.
"""

from __future__ import annotations

import torch
from torch import nn

from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.kernels import packable

QUANTIZATIONS = ("none", "int8", "int4", "auto")
GROUP = 32  # inputs per scale (and minimum), int4 and grouped int8 alike, as in llama.cpp


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b with W quantized; `matmul` is the kernel, fed 2-D activations in compute_dtype.
    The CPU kernels are fast with bf16 activations only (with fp32 ones int8 and int4 ran slower than
    plain fp32 weights), so products are taken in bf16 there."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        cpu = linear.weight.device.type == "cpu"
        self.compute_dtype = torch.bfloat16 if cpu else linear.weight.dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Conversions only where needed: a no-op .to() is still a dispatch, four of them per layer.
        rows = x.flatten(0, -2)
        y = self.matmul(rows if rows.dtype == self.compute_dtype else rows.to(self.compute_dtype))
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.unflatten(0, x.shape[:-1])


class Int8Linear(QuantizedLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(self.compute_dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch._weight_int8pack_mm(x, self.weight, self.scale)
        # PyTorch's CUDA int8-weight kernel takes fp32 only: dequantize on the fly.
        return (x @ self.weight.to(x.dtype).T) * self.scale


def _groups(linear: nn.Linear) -> torch.Tensor:
    """The weight in fp32 as [out, in/GROUP, GROUP]: the groups that share a scale."""
    out, n_in = linear.weight.shape
    return linear.weight.detach().float().view(out, n_in // GROUP, GROUP)


class Int4Linear(QuantizedLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        out, n_in = linear.weight.shape
        groups = _groups(linear)
        low, high = groups.amin(-1), groups.amax(-1)  # [out, in/32]
        step = ((high - low) / 15).clamp_min(1e-12)
        q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(out, n_in)
        self.native = linear.weight.device.type == "cpu" and native.quantized_usable(out, n_in)
        if self.native:
            packed, scale, minimum = native.int4_layout(q, step, low)
            self.register_buffer("weight", packed)
            self.register_buffer("scale", scale)
            self.register_buffer("minimum", minimum)
            return
        self.register_buffer("weight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # The kernel reads w = (q − 8)·scale + zero, from a [in/32, out, 2] table.
        table = torch.stack((step, low + 8 * step), -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", table.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native.int4_mm(x, self.weight, self.scale, self.minimum)
        return torch._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scales_and_zeros)


class Int8GroupLinear(QuantizedLinear):
    """int8 weights in groups of 32 inputs with a scale each (llama.cpp's Q8_0), on the native kernel
    (int8 activations per 32, VNNI or AMX): finer than Int8Linear's one scale per output, and flat in the
    rows (a verify pass) where PyTorch's int8 kernel is not."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        out, n_in = linear.weight.shape
        groups = _groups(linear)
        # The kernel reads the scale in bf16: q is chosen for that scale.
        scale = (groups.abs().amax(-1) / 127).clamp_min(1e-12).to(torch.bfloat16).float()  # [out, in/32]
        q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8).view(out, n_in)
        packed, scale = native.int8_layout(q, scale)
        self.register_buffer("weight", packed)
        self.register_buffer("scale", scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return native.int8_mm(x, self.weight, self.scale)


def matching_quantization(bits_per_weight: float, device: torch.device) -> str:
    """`auto`: the weight-only quantization closest to how a file stores its layers (a Q4 GGUF runs
    int4 like llama.cpp does, a Q8_0 one int8), none for 16- and 32-bit files."""
    if bits_per_weight <= 6 and device.type == "cpu":
        return "int4"
    return "int8" if bits_per_weight <= 9 else "none"


def int4_supported(linear: nn.Linear) -> bool:
    out, n_in = linear.weight.shape
    return n_in % GROUP == 0 and out % 16 == 0


def quantize(model: nn.Module, method: str | None) -> nn.Module:
    """Replace every nn.Linear by its quantized version, in place, but a 16-bit lm_head on CPU and a layer
    marked keep_precision (an MoE router). With
    int4 the lm_head (often the embedding matrix, which GGUF files keep at 6-8 bits) gets int8 in groups
    where the AMX kernel runs, else stays 16-bit: at 4 bits its logits move far more than the decoder
    layers' outputs do."""
    if method in (None, "none"):
        return model
    if method == "int4" and model.device.type != "cpu":
        raise SpeculantError("--quantization int4 has a CPU kernel only; use int8 or bfloat16 on "
                             f"{model.device.type}")
    head = getattr(model, "lm_head", None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or getattr(child, "keep_precision", False):
                continue
            if child is head and method == "int4" and _grouped_int8_head(child):
                setattr(parent, name, Int8GroupLinear(child))
            elif child is head and _head_stays_16_bit(child):
                continue
            elif method == "int8" or child is head:
                setattr(parent, name, Int8Linear(child))
            elif int4_supported(child):
                setattr(parent, name, Int4Linear(child))
    return model


def _grouped_int8_head(head: nn.Linear) -> bool:
    """With int4 layers, the lm_head in int8 groups (Q8_0, as GGUF files keep the embedding) on AMX: half
    a 16-bit head's bytes, a large share of a small model's pass (SmolLM2-135M: 57 of ~125 MB). int4
    runs on CPUs only (quantize refuses other devices)."""
    return native.quantized_usable(*head.weight.shape)


def _head_stays_16_bit(head: nn.Linear) -> bool:
    """A verify pass scores k + 1 rows per sequence with the lm_head, and the CPU int8 kernel's cost
    grows with every row where oneDNN's packed 16-bit kernel stays flat: at one row a whole pass costs
    the same either way, with more rows the 16-bit head is cheaper."""
    return head.weight.dtype in (torch.bfloat16, torch.float16) and packable(head)
