"""GGUF's quantized block formats repacked, exactly, into the native kernel's layout (csrc/ggml_mm.cpp).

Each format is read as one form, per group of 32 inputs of one output:
    w = (D·sc_h)·(u − offset) + M·mn
u the stored unsigned value, sc_h an int8 scale per half group (Q6_K) or group, D and M fp16 per superblock
(256 inputs for K-quants, 32 for the others), mn a uint8 per group where the format has a minimum. Every
value equals the one `gguf`'s dequantizer computes (tests/models/test_ggml.py): the target is the file's model.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from speculant.models import native

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Format:
    bits: int  # of u: 4, 5, 6 or 8
    halves: int  # scales a group: 2 where each 16 inputs have their own (Q6_K)
    offset: int
    superblock: int  # groups that share D (and M)
    mins: bool


FORMATS = {
    T.Q4_0: Format(4, 1, 8, 1, False),
    T.Q4_1: Format(4, 1, 0, 1, True),
    T.Q5_0: Format(5, 1, 16, 1, False),
    T.Q8_0: Format(8, 1, 128, 1, False),
    T.Q4_K: Format(4, 1, 0, 8, True),
    T.Q5_K: Format(5, 1, 0, 8, True),
    T.Q6_K: Format(6, 2, 32, 8, False),
}


@dataclass
class Blocks:
    """A tensor's blocks decoded into the common form; shapes for N outputs of K inputs, G = K/32."""
    fmt: Format
    u: np.ndarray  # [N, K] uint8
    sc: np.ndarray  # [N, G, halves] int8
    d: np.ndarray  # [N, G / superblock] fp16
    mn: np.ndarray | None = None  # [N, G] uint8
    m: np.ndarray | None = None  # [N, G / superblock] fp16

    def padded(self, multiple: int = 16) -> Blocks:
        """Zero outputs appended up to a multiple of the kernel's block of 16 (a vocabulary of any size)."""
        extra = -len(self.u) % multiple

        def pad(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.concatenate((a, np.zeros((extra, *a.shape[1:]), a.dtype)))

        return Blocks(self.fmt, pad(self.u), pad(self.sc), pad(self.d), pad(self.mn), pad(self.m)) if extra else self

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, in the order of operations the kernel's form states (the exactness reference)."""
        f = self.fmt
        N, K = self.u.shape
        G = K // 32
        d = np.repeat(self.d.astype(np.float32), f.superblock, axis=1)  # [N, G]
        scale = d[..., None] * self.sc.astype(np.float32)  # [N, G, halves]
        q = (self.u.astype(np.int32) - f.offset).astype(np.float32).reshape(N, G, f.halves, 32 // f.halves)
        w = scale[..., None] * q
        if f.mins:
            m = np.repeat(self.m.astype(np.float32), f.superblock, axis=1) * self.mn.astype(np.float32)
            w = w + m[:, :, None, None]
        return w.reshape(N, K)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """[B, n/2] bytes → [B, n]: the low nibbles are the first n/2 values, the high ones the rest."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1).reshape(len(qs), n)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K-quants' 12 bytes → 8 six-bit scales and 8 six-bit minimums a superblock."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=1)
    return sc, mn


def decode(qtype: T, raw: np.ndarray, n_out: int, n_in: int) -> Blocks:
    """A GGUF tensor's raw bytes [n_out, bytes a row] → its Blocks."""
    fmt = FORMATS[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)  # [blocks, bytes]
    G = n_in // 32
    ones = np.ones((n_out, G, 1), np.int8)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0):
        d = _f16(b[:, :2]).reshape(n_out, G)
        if qtype == T.Q8_0:
            u = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return Blocks(fmt, u.reshape(n_out, n_in), ones, d)
        if qtype == T.Q4_0:
            return Blocks(fmt, _nibbles(b[:, 2:], 32).reshape(n_out, n_in), ones, d)
        if qtype == T.Q4_1:
            u = _nibbles(b[:, 4:], 32).reshape(n_out, n_in)
            return Blocks(fmt, u, ones, d, np.ones((n_out, G), np.uint8), _f16(b[:, 2:4]).reshape(n_out, G))
        high = (b[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1  # Q5_0
        u = _nibbles(b[:, 6:], 32) | (high.astype(np.uint8) << 4)
        return Blocks(fmt, u.reshape(n_out, n_in), ones, d)
    n_super = n_in // 256
    if qtype == T.Q6_K:
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        low = np.stack((ql & 0x0F, ql >> 4), axis=2).reshape(-1, 256)  # [half of 128, nibble, 64]
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(-1, 256)
        sc = b[:, 192:208].view(np.int8).reshape(n_out, G, 2)
        return Blocks(fmt, (low | (high << 4)).reshape(n_out, n_in), sc, _f16(b[:, 208:210]).reshape(n_out, n_super))
    d, dmin = _f16(b[:, :2]).reshape(n_out, n_super), _f16(b[:, 2:4]).reshape(n_out, n_super)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, -128:].reshape(-1, 4, 32)
    u = np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(-1, 256)  # each 32 bytes: two groups' nibbles
    if qtype == T.Q5_K:
        qh = b[:, 16:48]
        u = u | ((((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4).reshape(-1, 256))
    minimum = (-dmin.astype(np.float32)).astype(np.float16)  # w = d·sc·u − dmin·mn; negation is exact
    return Blocks(fmt, u.reshape(n_out, n_in), sc.astype(np.int8).reshape(n_out, G, 1), d, mn.reshape(n_out, G),
                  minimum)


def layout(blocks: Blocks) -> list[torch.Tensor]:
    """Blocks → the kernel's 7 tensors (csrc/ggml_mm.cpp; sc and mn empty where they are all 1). Per block of
    16 outputs and group of 32 inputs, vector v of the unpacked weights holds byte 4j + e = u[j][4v + e];
    nibble planes keep vectors v and v + 4 in one byte's low and high halves, high planes the bits above
    the nibble of vector v in bit v (5 bits) or bits 2(v mod 4), +1 of vector v / 4 (6 bits)."""
    f = blocks.fmt
    N, K = blocks.u.shape
    G = K // 32
    u = torch.from_numpy(blocks.u).view(N // 16, 16, G, 8, 4).permute(0, 2, 3, 1, 4)  # block, g, v, j, e
    if f.bits == 8:
        low, high = u.reshape(N // 16, G, 512).contiguous(), torch.empty(0, dtype=torch.uint8)
    else:
        nib = u & 0x0F
        low = (nib[:, :, :4] | (nib[:, :, 4:] << 4)).reshape(N // 16, G, 256).contiguous()
        hi = u >> 4  # uint8 throughout: the shifted bits never pass bit 7
        if f.bits == 4:
            high = torch.empty(0, dtype=torch.uint8)
        elif f.bits == 5:
            high = hi[:, :, 0].clone()
            for v in range(1, 8):
                high |= hi[:, :, v] << v
            high = high.reshape(N // 16, G, 64)
        else:
            high = hi[:, :, 0::4].clone()  # [B, G, 2, j, e]: vectors 0 and 4, then the next three of each
            for s in range(1, 4):
                high |= hi[:, :, s::4] << (2 * s)
            high = high.reshape(N // 16, G, 128)

    def per_block(a: np.ndarray) -> torch.Tensor:  # [N, X, ...] → [N/16, X, ..., 16]
        t = torch.from_numpy(np.ascontiguousarray(a)).view(N // 16, 16, *a.shape[1:])
        return t.movedim(1, -1).contiguous()

    empty = torch.empty(0, dtype=torch.uint8)
    fmt = torch.tensor([f.bits, f.halves, f.offset, f.superblock], dtype=torch.int64)
    unit = f.superblock == 1  # sc and mn are all 1: the kernel reads D and M alone
    sc = empty.to(torch.int8) if unit else per_block(blocks.sc)
    mn = empty if unit or not f.mins else per_block(blocks.mn)
    return [low, high, sc, per_block(blocks.d), mn, per_block(blocks.m) if f.mins else empty, fmt]


def usable(qtype: T, n_out: int, n_in: int) -> bool:
    """Whether the native kernel takes this tensor as stored (outputs past a multiple of 16 padded: the head)."""
    if qtype not in FORMATS or n_in % 32 or native.level() == "off":
        return False
    return n_in % (32 * FORMATS[qtype].superblock) == 0


class GGMLLinear(nn.Module):
    """y = x Wᵀ + b, W one or more GGUF tensors stacked by output (a fused qkv whose v has other bits), each in
    its own stored format."""

    def __init__(self, parts: list[list[torch.Tensor]], in_features: int, bias: torch.Tensor | None = None,
                 out_features: int | None = None):
        super().__init__()
        self.in_features = in_features
        self.stored_features = sum(p[0].shape[0] * 16 for p in parts)
        self.out_features = out_features or self.stored_features  # fewer: the last part's padding is dropped
        self.weights = [t for p in parts for t in p]  # what the kernel takes, 7 tensors a part
        for i, t in enumerate(self.weights):
            self.register_buffer(f"w{i}", t, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.flatten(0, -2)
        y = native.ggml_mm(rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16), self.weights)
        if self.out_features < self.stored_features:
            y = y[:, :self.out_features]
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.unflatten(0, x.shape[:-1])

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{int(self.weights[i + 6][0])}-bit" for i in range(0, len(self.weights), 7))
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{kinds}]"
