"""Weight-only int8 quantization (per output channel, symmetric) of a model's linear layers.

Decoding at batch 1 streams every weight once per pass: int8 weights are a quarter of fp32's
bytes. Activations stay in the model's dtype. The quantized model is a different target: its
speculative output equals its own plain output, not the fp32 model's.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        # The CPU int8-weight kernel is fast with bf16 activations only: with fp32 ones it runs ~4× slower
        # than plain fp32 weights (measured, SmolLM2-135M). Its products are taken in bf16 there.
        cpu = w.device.type == "cpu"
        self.compute_dtype = torch.bfloat16 if cpu else linear.weight.dtype
        self.register_buffer("scale", scale.to(self.compute_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.compute_dtype)
        try:
            y = torch._weight_int8pack_mm(x2, self.weight, self.scale)
        except (NotImplementedError, RuntimeError):
            # No int8-weight kernel for this device or dtype: dequantize on the fly.
            y = (x2 @ self.weight.to(x2.dtype).T) * self.scale
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize(model: nn.Module, method: str | None) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by its int8 version, in place."""
    if method in (None, "none"):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return model
