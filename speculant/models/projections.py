"""A projection's weights as the native kernels take them, whichever kernel its layer runs: what the whole-layer
calls (csrc/decoder.cpp, csrc/moe.cpp) read instead of calling the layer module; and fuse_on_load, which stores
several of a checkpoint's projections as one."""

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


def fuse_on_load(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Store the linear layers `parts` (name → output rows) as one, `fused`: one matmul reads all
    their weights in a pass. Checkpoints keep the separate Hugging Face names both ways: they are
    concatenated on load and split again in state_dict()."""

    def merge(state, prefix, *_):
        for suffix in ("weight", "bias"):
            names = [f"{prefix}{p}.{suffix}" for p in parts]
            if all(n in state for n in names):
                state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(n) for n in names])

    def split(_module, state, prefix, _meta):
        for suffix in ("weight", "bias"):
            key = f"{prefix}{fused}.{suffix}"
            # Only a plain [out, in] weight splits into the checkpoint's layers; packed or quantized
            # inference layouts (models/kernels.py, quantize.py) are not checkpoints.
            if key in state and state[key].shape[0] == sum(parts.values()) and not state[key].is_mkldnn:
                for p, piece in zip(parts, state.pop(key).split(list(parts.values()))):
                    state[f"{prefix}{p}.{suffix}"] = piece

    module.register_load_state_dict_pre_hook(lambda _m, state, prefix, *a: merge(state, prefix))
    module.register_state_dict_post_hook(split)
