"""A preallocated KV cache: one row (slot) per sequence, each with its own length.

Rollback is O(1): shrinking a slot's length makes the keys past it invisible (the attention
mask stops at the length) and the next append overwrites them.

Each row has one position more than max_len, a sink: a ragged pass pads short rows to the widest,
and a padded entry that would land past the last position is written there instead (prepare_pass).
No row ever sees it (a row's length is at most max_len). Without it a row near the end of its
context could not share a pass with a row feeding many tokens (an EAGLE head catching up on a
long stretch in one row, one token in another).

On a CPU the cache is sized for every row at the whole context but costs memory only where written:
it lives in an anonymous mapping, whose pages the kernel gives (zeroed) at their first write, and a
freed row's pages go back (release). Positions never written read as zeros, so attention's masked
products stay finite.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from speculant.errors import SpeculantError


class KVCache:
    def __init__(self, n_layers: int, max_batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (n_layers, max_batch, n_kv_heads, max_len + 1, head_dim)  # + the sink
        self._maps: list[mmap.mmap] = []  # on CPU, the mappings k and v live in
        self.k = self._zeros(shape, dtype, torch.device(device))
        self.v = self._zeros(shape, dtype, torch.device(device))
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        # On CPU the same memory as numpy: setting a row's length from Python is far cheaper there than
        # indexing the tensor with a new one, which every decoding step does.
        self._host_lengths = self.lengths.numpy() if self.lengths.device.type == "cpu" else None
        self.max_len = max_len

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeros; on a CPU in pages taken only as they are written (torch.zeros writes them all at once)."""
        if device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
            return torch.zeros(shape, dtype=dtype, device=device)
        # Private: the pages of a shared anonymous mapping outlive MADV_DONTNEED.
        mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE)
        self._maps.append(mapping)
        return torch.frombuffer(mapping, dtype=dtype).view(shape)

    def release(self, slot: int) -> None:
        """Give a freed row's memory back: its pages read as zeros until a later sequence writes them."""
        if not self._maps:
            return
        L, B, H, T, D = self.k.shape
        row = H * T * D * self.k.element_size()  # one layer's keys (or values) of a row, contiguous
        for mapping in self._maps:
            for layer in range(L):
                start = (layer * B + slot) * row
                first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
                end = (start + row) // mmap.PAGESIZE * mmap.PAGESIZE
                if end > first:  # whole pages only: the pages at the ends hold neighbouring rows too
                    mapping.madvise(mmap.MADV_DONTNEED, first, end - first)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    def check_capacity(self, end: int) -> None:
        if end > self.max_len:
            raise SpeculantError(f"sequence needs {end} cache positions; the cache holds {self.max_len}")

    def index(self, slots: torch.Tensor, positions: torch.Tensor, span: int) -> CacheIndex:
        """Where a pass writes its keys (rows `slots` [B] at `positions` [B, T]) and what it reads
        back (those rows' first `span` positions). Plain slices, views without a copy, in the common
        cases: one row, or contiguous rows for the read."""
        ids = slots.tolist()
        first, B = ids[0], len(ids)
        if B == 1:
            # Views of every layer at once: a layer then selects its own (cheaper than indexing the
            # cache with a tuple per layer).
            p = int(positions[0, 0])
            new = (slice(None), first, slice(None), slice(p, p + positions.shape[1]))
            seen = (slice(None), slice(first, first + 1), slice(None), slice(0, span))
            return CacheIndex((self.k[new], self.v[new]), (self.k[seen], self.v[seen]), one_row=True)
        heads = torch.arange(self.k.shape[2], device=slots.device)
        write = (slots[:, None, None], heads[None, :, None], positions[:, None, :])
        rows = slice(first, first + B) if ids == list(range(first, first + B)) else slots
        return CacheIndex(write, (rows, slice(None), slice(0, span)))

    def update(self, layer: int, at: CacheIndex, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, Dh] where `at` says; return the rows' keys and values [B, Hkv, span, Dh]. A layer
        with fewer heads or a narrower head than the cache's (Gemma 4's sliding layers beside its global ones) uses
        the first of each."""
        H, D = k.shape[1], k.shape[-1]
        narrow = (H, D) != (self.k.shape[2], self.k.shape[-1])
        if at.one_row:
            (k_new, v_new), (keys, values) = at.write, at.read
            k_new[layer, :H, :, :D].copy_(k[0])
            v_new[layer, :H, :, :D].copy_(v[0])
            return keys[layer][:, :H, :, :D], values[layer][:, :H, :, :D]
        kc, vc = self.k[layer][..., :D], self.v[layer][..., :D]
        write = (at.write[0], at.write[1][:, :H], at.write[2]) if narrow else at.write
        kc[write] = k
        vc[write] = v
        return kc[at.read][:, :H], vc[at.read][:, :H]

    def read(self, layer: int, at: CacheIndex, n_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values [B, n_heads, span, head_dim] of cache layer `layer`, as update returns them,
        writing nothing: a KV-shared layer reads its source's (Gemma 4)."""
        H, D = n_heads, head_dim
        if at.one_row:
            keys, values = at.read
            return keys[layer][:, :H, :, :D], values[layer][:, :H, :, :D]
        return self.k[layer][..., :D][at.read][:, :H], self.v[layer][..., :D][at.read][:, :H]

    def rollback(self, slot: int, length: int) -> None:
        self.set_lengths([slot], [length])

    def set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        if self._host_lengths is not None:
            for slot, length in zip(slots, lengths):  # scalar writes: numpy's indexing by a list costs more
                self._host_lengths[slot] = length
        else:
            self.lengths[torch.tensor(slots, device=self.lengths.device)] = torch.tensor(lengths,
                                                                                        device=self.lengths.device)

    def share_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Give rows `dst` row src's first `length` positions, keys, values and length: requests with
        the same prompt share one prefill."""
        if not dst:  # a request alone: nothing to copy (the copy's source clone is a whole prompt's keys)
            return
        rows = torch.tensor(dst, dtype=torch.long, device=self.k.device)
        for cache in (self.k, self.v):
            cache[:, rows, :, :length] = cache[:, src:src + 1, :, :length].clone()  # index_put refuses views of itself
        self.set_lengths(dst, [length] * len(dst))

    @property
    def row_bytes_per_token(self) -> int:
        """Bytes of keys and values one position of a row holds, every layer."""
        L, _, H, _, D = self.k.shape
        return 2 * L * H * D * self.k.element_size()

    def read_row(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row slot's first `length` keys and values [layers, kv heads, length, head dim]."""
        return self.k[:, slot, :, :length].clone(), self.v[:, slot, :, :length].clone()

    def write_row(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Row slot's first positions from keys and values [layers, kv heads, n, head dim]; the length
        is the caller's to set."""
        n = k.shape[2]
        self.check_capacity(n)
        self.k[:, slot, :, :n].copy_(k)
        self.v[:, slot, :, :n].copy_(v)

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values at positions `src` of a row to positions `dst`, every layer: the
        branch a draft tree's verification kept goes where the sequence continues."""
        at_src, at_dst = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        for cache in (self.k, self.v):
            cache[:, slot, :, at_dst] = cache[:, slot, :, at_src]


@dataclass
class CacheIndex:
    write: tuple  # indices into a layer's cache; one_row: the (keys, values) views [L, Hkv, T, Dh] written
    read: tuple  # indices into a layer's cache; one_row: the (keys, values) views [L, 1, Hkv, span, Dh] read
    one_row: bool = False

