"""The cache of a hybrid model (Qwen3.5, Qwen3-Next): keys and values for its attention layers, and for its Gated
DeltaNet layers (gdn.py) each row's recurrent states, held by the length they follow.

Rollback everywhere in the engine is a length change (set_lengths). For keys that hides the positions past it; a
recurrent state has no positions, so a pass hands over the state after each of its positions (references to
tensors the recurrence made anyway: nothing is copied) and setting a length picks the state held for it and drops
the others. A length with no state held raises: a wrong state is never guessed. A row's pass as narrow as a
verification (`rollback_width`: the engine's k + 1) keeps every position; a wider one (a prompt) only its end and
the lengths asked for with `pin` (a state is 2 MiB a DeltaNet layer at Qwen3.5-4B's shape).
States are never written in place, so rows may share them (share_prefix) and the prefix cache may keep them.
"""

from __future__ import annotations

import torch

from speculant.errors import SpeculantError
from speculant.models.kv_cache import KVCache
from speculant.models.limits import MAX_VERIFY_WIDTH

# One layer's state of a row: (recurrent matrix [v heads, dk, dv] fp32, conv window [channels, K − 1]).
LayerState = tuple[torch.Tensor, torch.Tensor]


class HybridCache(KVCache):
    def __init__(self, n_attention: int, max_batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, n_linear: int,
                 shapes: tuple[tuple[int, ...], tuple[int, ...]]):
        super().__init__(n_attention, max_batch, n_kv_heads, max_len, head_dim, dtype, device)
        self.n_linear, self.shapes, self.dtype = n_linear, shapes, dtype
        self.states: list[dict[int, list[LayerState | None]]] = [{} for _ in range(max_batch)]
        self.pinned: list[set[int]] = [set() for _ in range(max_batch)]
        # The widest row a rollback may land inside: a verification's pending token and its drafts.
        self.rollback_width = MAX_VERIFY_WIDTH

    # -- what a Gated DeltaNet layer's pass reads and hands back --------------------------------------

    def read_states(self, layer: int, slots: list[int], starts: list[int],
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' states at the lengths they start from → ([B, v heads, dk, dv] fp32, [B, C, K − 1])."""
        matrices, windows = [], []
        for slot, start in zip(slots, starts):
            held = self.states[slot].get(start)
            if held is None and start == 0:
                matrices.append(torch.zeros(self.shapes[0], device=self.k.device))
                windows.append(torch.zeros(self.shapes[1], dtype=dtype, device=self.k.device))
                continue
            if held is None or held[layer] is None:
                raise SpeculantError(f"cache row {slot} holds no recurrent state at length {start}")
            matrices.append(held[layer][0])
            windows.append(held[layer][1].to(dtype))
        if len(slots) == 1:
            return matrices[0][None], windows[0][None]
        return torch.stack(matrices), torch.stack(windows)

    def positions_to_keep(self, slots: list[int], starts: list[int], n_real: list[int], T: int) -> list[list[int]]:
        """For each step t of a pass, the rows whose state after t + 1 tokens is kept."""
        keep: list[list[int]] = [[] for _ in range(T)]
        for row, (slot, start, n) in enumerate(zip(slots, starts, n_real)):
            wanted = range(1, n + 1) if n <= self.rollback_width else \
                {n} | {p - start for p in self.pinned[slot] if start < p <= start + n}
            for t in wanted:
                keep[t - 1].append(row)
        return keep

    def record_state(self, layer: int, slot: int, length: int, matrix: torch.Tensor, window: torch.Tensor) -> None:
        self.states[slot].setdefault(length, [None] * self.n_linear)[layer] = (matrix, window)

    # -- lengths ---------------------------------------------------------------------------------------

    def has_state(self, slot: int, length: int) -> bool:
        held = self.states[slot].get(length)
        return length == 0 or (held is not None and None not in held)

    def state_at(self, slot: int, length: int) -> list[LayerState] | None:
        """Row slot's states at `length` (every layer's), or None where none is held."""
        return list(self.states[slot][length]) if length and self.has_state(slot, length) else None

    def state_lengths(self, slot: int) -> list[int]:
        """The lengths row slot holds every layer's states for."""
        return [n for n, s in self.states[slot].items() if None not in s]

    def put_state(self, slot: int, length: int, state: list[LayerState]) -> None:
        self.states[slot] = {length: list(state)}

    def pin(self, slot: int, length: int) -> None:
        """Keep row slot's state at `length` when a prompt's pass runs past it, and when later lengths are set:
        the boundary a prefix cache entry can start from (a prompt's end)."""
        self.pinned[slot].add(length)

    def set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        for slot, length in zip(slots, lengths):
            if not self.has_state(slot, length):
                raise SpeculantError(f"cache row {slot} holds no recurrent state at length {length}: it cannot "
                                     "roll back there")
            held = self.states[slot]
            self.states[slot] = {n: s for n, s in held.items()
                                 if n == length or (n < length and n in self.pinned[slot] and None not in s)}
        super().set_lengths(slots, lengths)

    def share_prefix(self, src: int, dst: list[int], length: int) -> None:
        state = self.state_at(src, length)
        if length and state is None:
            raise SpeculantError(f"cache row {src} holds no recurrent state at length {length} to share")
        for slot in dst:
            self.states[slot] = {length: list(state)} if length else {}
        super().share_prefix(src, dst, length)

    def release(self, slot: int) -> None:
        self.states[slot], self.pinned[slot] = {}, set()
        super().release(slot)

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        raise SpeculantError("a draft tree's branches need a recurrent state per node; hybrid models verify chains")

    @property
    def state_bytes(self) -> int:
        """Bytes one row's states take at one length, every linear layer."""
        (h, dk, dv), (c, w) = self.shapes
        return self.n_linear * (4 * h * dk * dv + c * w * self.dtype.itemsize)
