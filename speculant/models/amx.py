"""The AMX int4 kernel (csrc/int4_amx.cpp): compiled on first use where the CPU has AMX and a C++
compiler is installed, else PyTorch's int4 kernel is used (same weights, a steeper cost per row).

Measured on this project's 2-core Sapphire Rapids VM, SmolLM2-135M's 120 int4 layers at 1 / 4 / 8 /
16 rows: PyTorch 5.1 / 9.9 / 14.7 / 29 ms, AMX 5.4 / 7.8 / 6.5 / 8.2 ms (interleaved, fastest of 15).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from speculant.models.kernels import cpu_flags

log = logging.getLogger("speculant")

SOURCE = Path(__file__).parent / "csrc" / "int4_amx.cpp"
NEEDED_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512vbmi", "avx512bw")
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi",
                 "-mamx-tile", "-mamx-bf16", "-fopenmp"]
# "torch" keeps PyTorch's kernel (to compare, or where a build misbehaves).
KERNEL_ENV = "SPECULANT_INT4_KERNEL"


@functools.cache
def int4_kernel() -> ModuleType | None:
    """The compiled kernel, or None (and why, logged once) where it cannot run here."""
    if os.environ.get(KERNEL_ENV, "auto") == "torch":
        return None
    missing = [f for f in NEEDED_FLAGS if f not in cpu_flags()]
    if missing:
        log.info("int4: PyTorch's kernel (this CPU lacks %s)", ", ".join(missing))
        return None
    try:
        from torch.utils.cpp_extension import load

        log.info("int4: AMX kernel (compiled on first use, ~30 s, then cached by PyTorch)")
        return load("speculant_int4_amx", [str(SOURCE)], extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, an old compiler without AMX: all mean the fallback
        log.warning("int4: PyTorch's kernel (the AMX kernel did not build: %s)", str(e).splitlines()[0][:200])
        return None


def usable(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 64 == 0 and int4_kernel() is not None


def layout(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q [N, K] in 0..15, scale and minimum [N, K/32] → the kernel's layout: per block of 16 outputs and
    group of 32 inputs, 16 rows (input pairs) of 16 bytes, byte j = q[j][2r] | q[j][2r+1] << 4; scales
    and minimums as bf16 [N/16, K/32, 16]."""
    N, K = q.shape
    pairs = q.view(N // 16, 16, K // 32, 16, 2)  # block, output, group, pair, member
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    def per_block(v: torch.Tensor) -> torch.Tensor:
        return v.view(N // 16, 16, K // 32).transpose(1, 2).contiguous().to(torch.bfloat16)

    return packed, per_block(scale), per_block(minimum)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 → [M, N] bf16."""
    return int4_kernel().int4_mm(x, packed, scale, minimum)
