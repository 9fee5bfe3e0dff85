"""One pass's attention: where its keys go in the cache, what each query sees (causal, a sliding window, a draft
tree), and the scores over them: on the native kernel, or PyTorch's SDPA row by row where only that is row-exact."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculant.models import native
from speculant.models.kv_cache import CacheIndex, KVCache
from speculant.models.limits import MAX_VERIFY_WIDTH
from speculant.models.rope import Rope


@dataclass
class Pass:
    """What every layer of one forward pass shares: where the cache is written and read, the
    attention mask, the rotary tables at the new positions."""
    cache: KVCache
    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B, T] where the new keys are written
    span: int  # keys the widest row sees after the pass
    mask: torch.Tensor | None  # additive [B, 1, T, span]; None when every key is visible
    cos: torch.Tensor  # [B, T, 1, Dh]
    sin: torch.Tensor
    end: torch.Tensor | None  # [B] the rows' cache lengths after the pass (None: the caller advances them)
    n_keys: torch.Tensor | None = None  # [B, T] keys each row sees, for the native kernel (see prepare_pass)
    window: int | None = None  # the native kernel's sliding window
    row_keys: list | None = None  # [B][T]: attend row by row over these keys (slices or indices; see prepare_pass)
    tree: torch.Tensor | None = None  # [B, T] int64: the new tokens row (b, t) sees, a bit each (draft trees)

    @functools.cached_property
    def at(self) -> CacheIndex:
        """Where the layer modules write and read the cache, built when the first one asks: a pass of
        native.decoder_layer calls writes the cache itself (building the index is not free at batch 1)."""
        return self.cache.index(self.slots, self.positions, self.span)


MAX_TREE_NODES = 64  # a pass's draft tree: each token's ancestors are the bits of an int64


def tree_layout(parents: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """A pass's new tokens as a draft tree, parents[b][t] the index of token t's parent among them (-1: the
    cached token before the pass; parents come before children) → (each token's depth below the cache,
    0 for a child of the cached token; each token's ancestors and itself as bits of the pass's tokens)."""
    depths, bits = [], []
    for row in parents:
        d, m = [], []
        for t, p in enumerate(row):
            d.append(d[p] + 1 if p >= 0 else 0)
            m.append((m[p] if p >= 0 else 0) | 1 << t)
        depths.append(d)
        bits.append(m)
    return depths, bits


def native_attention_usable(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a pass attends on the native kernel (each row over exactly its keys, within its sliding window):
    bf16 or fp32 on CPU, a head size the kernel takes."""
    return dtype in (torch.bfloat16, torch.float32) and device.type == "cpu" and native.attention_usable(head_dim)


def prepare_pass(cache: KVCache, slots: torch.Tensor, T: int, n_new: torch.Tensor | None, rope: Rope,
                 inv_freq: torch.Tensor, dtype: torch.dtype, window: int | None = None,
                 parents: list[list[int]] | None = None, native_ok: bool = True) -> Pass:
    """Row b's T inputs go at positions cache.lengths[slots[b]] onward; only its first n_new[b]
    (default T) are real, the rest is padding whose keys are never attended to and are overwritten
    later; padding past the last position goes to the cache's sink (KVCache).

    With `parents` (see tree_layout) the inputs are a draft tree: each is rotated for its depth and sees
    the cache and its own ancestors only, as if its branch had been decoded alone; the caller moves
    the keys of the branch it keeps into place (KVCache.move). `native_ok` False: never the native kernel
    (attention sinks, which it does not add)."""
    start = cache.lengths[slots]  # [B]
    end = start + (T if n_new is None else n_new)
    span = int(end.max())
    cache.check_capacity(span)
    steps = torch.arange(T, device=slots.device)
    positions = start[:, None] + steps  # [B, T]
    if n_new is not None and span + T > cache.max_len:
        positions = positions.clamp(max=cache.max_len)
    tree = depths = bits = None
    rotated = positions  # [B, T] the positions rotary embeddings see
    if parents is not None:
        depths, bits = tree_layout(parents)
        rotated = start[:, None] + torch.tensor(depths, device=slots.device)
        tree = torch.tensor(bits, device=slots.device)
    cos, sin = rope(inv_freq, rotated, dtype)
    mask = row_keys = n_keys = None
    # PyTorch's CPU attention sums in an order that depends on the key count and the call's other rows,
    # and one rounding step makes that visible. A position's keys and values must be the same bits
    # whatever pass computed them (a whole prompt, a chunk of one, a verify pass, a decode step), or
    # speculative output drifts from plain output and a cached prefix (prefix_cache.py) differs from a
    # cold prefill. The native kernel attends each row over its own keys alone, in every pass; without
    # it, one sequence's passes attend row by row (linear kernels are row-invariant, models/kernels.py).
    if native_ok and native_attention_usable(dtype, slots.device, 2 * len(inv_freq)):
        n_keys = positions + 1
    elif slots.device.type != "cpu" and (T > MAX_VERIFY_WIDTH or len(slots) > 1 or T == 1 or dtype == torch.float32
                                         or window is not None):
        # CUDA: its prompts and batches on its blocked kernels (row invariance there is docs/cuda.md's).
        if tree is not None or not (len(slots) == 1 and T == 1 and (window is None or span <= window)):
            mask = attention_mask(rotated, start, span, window, dtype, tree)
    elif tree is None and not (len(slots) == 1 and T == 1 and (window is None or span <= window)):
        low = (lambda p: 0) if window is None else (lambda p: max(0, p + 1 - window))
        row_keys = [[slice(low(p), p + 1) for p in range(first, first + T)] for first in start.tolist()]
    elif tree is not None:
        # A masked SDPA over a batch of trees is not row-exact: every row's nodes go row by row.
        real = [T] * len(slots) if n_new is None else n_new.tolist()
        row_keys = tree_row_keys(start.tolist(), real, depths, bits, window, slots.device)
    return Pass(cache, slots, positions, span, mask, cos, sin, end, n_keys, window, row_keys, tree)


def tree_row_keys(starts: list[int], real: list[int], depths: list[list[int]], bits: list[list[int]],
                  window: int | None, device: torch.device) -> list[list[torch.Tensor]]:
    """[B][T] the cache indices each node of a draft tree attends to: the cached keys, then its ancestors' and
    its own, each kept only if its position on the node's branch (a new key's is its depth) is in the window,
    as decoding the branch alone would see them. Row b's nodes past its first real[b] are padding: they read
    the last cached key (their output is never read, and their keys may lie past the pass's span)."""
    rows = []
    for first, n_real, row_depths, row_bits in zip(starts, real, depths, bits):
        row = []
        for t, (depth, lineage) in enumerate(zip(row_depths, row_bits)):
            if t >= n_real:
                row.append(torch.tensor([first - 1], device=device))
                continue
            low = 0 if window is None else min(first, max(0, first + depth + 1 - window))
            seen = [first + j for j, d in enumerate(row_depths)
                    if lineage >> j & 1 and (window is None or d > depth - window)]
            row.append(torch.cat((torch.arange(low, first, device=device), torch.tensor(seen, device=device))))
        rows.append(row)
    return rows


def attention_mask(positions: torch.Tensor, start: torch.Tensor, span: int, window: int | None, dtype: torch.dtype,
                   tree: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, T, span]: a query at position p sees keys 0..p (no further back than the window); in a
    draft tree (`tree`, see Pass) only the new keys of its ancestors and itself."""
    keys = torch.arange(span, device=positions.device)
    allowed = keys[None, None, :] <= positions[..., None]
    if tree is not None:
        new = (keys[None, :] - start[:, None]).clamp(0, MAX_TREE_NODES - 1)  # [B, span] a new key's bit
        allowed = (keys[None, None, :] < start[:, None, None]) | ((tree[..., None] >> new[:, None, :]) & 1 == 1)
    if window:
        # A tree's new key stands at its node's depth on the branch, not at its index in the cache.
        at = keys.expand(len(start), span)
        if tree is not None:
            new = keys[None, :] - start[:, None]  # [B, span]
            at = torch.where(new >= 0, positions.gather(1, new.clamp(0, positions.shape[1] - 1)), at)
        allowed &= at[:, None, :] > positions[..., None] - window
    # Additive once here rather than a boolean mask converted by every layer's attention.
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, -math.inf)[:, None]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(x / cap) in x's dtype, in transformers' order (Gemma 2's scores and logits); x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, enable_gqa: bool = False, scale: float | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention with the scores soft-capped before the mask, which SDPA cannot do: the scores
    written out as transformers' eager attention computes them, the softmax in fp32."""
    if enable_gqa:
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = soft_cap(q @ keys.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale), softcap)
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   enable_gqa: bool = False, scale: float | None = None, sinks: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks` [Hq], that weighs no value (gpt-oss): the
    scores written out as transformers' eager attention computes them."""
    if enable_gqa:
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores + attn_mask
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat((scores, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(values.dtype) @ values


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fwd: Pass, gqa: bool,
           scale: float | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, Hq, Dh], keys/values [B, Hkv, span, Dh] → [B, T, Hq, Dh]; scores scaled by `scale` (1/√Dh) and
    soft-capped by `softcap`; `sinks` [Hq]: a sink logit per head in the softmax (the pass never native)."""
    if fwd.n_keys is not None:
        if sinks is not None:
            raise ValueError("attention sinks need a pass prepared off the native kernel (prepare_pass native_ok)")
        return native.attention(q, keys, values, fwd.n_keys, fwd.tree, fwd.window, scale, softcap)
    q = q.transpose(1, 2)
    sdpa = F.scaled_dot_product_attention if softcap is None else functools.partial(capped_attention, softcap=softcap)
    if sinks is not None:
        sdpa = functools.partial(sink_attention, sinks=sinks)
    if fwd.row_keys is None:
        out = sdpa(q, keys, values, attn_mask=fwd.mask, enable_gqa=gqa, scale=scale)
    else:
        out = torch.cat([torch.cat([sdpa(q[b:b + 1, :, t:t + 1], keys[b:b + 1, :, seen], values[b:b + 1, :, seen],
                                         enable_gqa=gqa, scale=scale)
                                    for t, seen in enumerate(row)], dim=2) for b, row in enumerate(fwd.row_keys)])
    return out.transpose(1, 2)
