"""A preallocated KV cache: one row (slot) per sequence, each with its own length.

Rollback is O(1): shrinking a slot's length makes the keys past it invisible (the attention
mask stops at the length) and the next append overwrites them.
"""

from __future__ import annotations

import torch

from speculant.errors import SpeculantError


class KVCache:
    def __init__(self, n_layers: int, max_batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (n_layers, max_batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    def check_capacity(self, end: int) -> None:
        if end > self.max_len:
            raise SpeculantError(f"sequence needs {end} cache positions; the cache holds {self.max_len}")

    @staticmethod
    def read_rows(slots: torch.Tensor) -> slice | torch.Tensor:
        """How to read the rows `slots`: a slice (a view, no copy) when they are contiguous, the
        common case, batch 1 included; else the index tensor (a gather)."""
        first = int(slots[0])
        if bool((slots == torch.arange(first, first + len(slots), device=slots.device)).all()):
            return slice(first, first + len(slots))
        return slots

    def update(self, layer: int, slots: torch.Tensor, rows: slice | torch.Tensor, positions: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, Dh] at `positions` [B, T] of rows `slots` [B]; return keys and
        values [B, Hkv, span, Dh] of those rows (`rows` from read_rows)."""
        kc, vc = self.k[layer], self.v[layer]
        at = (slots[:, None, None], torch.arange(kc.shape[1], device=kc.device)[None, :, None],
              positions[:, None, :])
        kc[at] = k
        vc[at] = v
        return kc[rows, :, :span], vc[rows, :, :span]

    def rollback(self, slot: int, length: int) -> None:
        self.lengths[slot] = length
