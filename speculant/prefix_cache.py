"""Keys and values the engine computed before, kept for the next request that starts the same way.

Agents and chat clients resend their whole conversation, or one long system prompt, at every call. Each
sequence that leaves the engine leaves its cache row here, keyed by the exact tokens it holds; a new
request copies the longest prefix it shares with any entry into its own row and prefills only the rest.

This is llama.cpp's slot reuse widened to a pool of past sequences, evicted least-recently-used under a
byte budget (SGLang's radix tree keeps the same thing as shared tree nodes; vLLM as hashed 16-token
blocks of a paged cache). A pool of whole sequences fits this engine: its native kernels read one
contiguous row per sequence, and on a CPU copying a prefix into a row costs milliseconds where
recomputing it costs seconds. An entry that is a prefix of a newer one (the previous turn of the same
conversation) is dropped when the newer one arrives, so a conversation holds one entry.

A hit is exact because every pass computes a position's keys and values with the same bits whatever
the pass (a whole prompt, a chunk, a decode step): the kernels' row invariance, docs/lossless.md.

With a folder (prefix_store.py) every entry kept is written there too, and a miss here looks there: what a
process computed serves the next one after a restart.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from speculant.models.kernels import inexact_reason
from speculant.models.kv_cache import KVCache
from speculant.prefix_store import PrefixStore, common_prefix

log = logging.getLogger("speculant")


def default_capacity_bytes() -> int:
    """An eighth of the machine's memory, at most 4 GiB: a few long conversations of a 1.5B model."""
    return min(4 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8)


def prefix_cache_for(model: torch.nn.Module, cache: KVCache, proposer, budget: int) -> PrefixCache | None:
    """The target's store of past sequences, and the proposer's own, sharing `budget` bytes in proportion to
    what a token costs each. None where it is off, where the kernels are not row-exact (a hit would not give a
    cold prefill's bits), or where the proposer cannot start from a cached prefix (it reads the target's
    features of the whole prompt)."""
    if budget <= 0:
        return None
    inexact = inexact_reason(model, model.device)
    if inexact is not None:
        log.warning("prefix caching is off: %s, so a cached prefix's keys would not be a cold prefill's", inexact)
        return None
    target = cache.row_bytes_per_token
    draft = proposer.kv_bytes_per_token if proposer is not None else 0
    share = budget * target // (target + draft)
    if proposer is not None and not proposer.use_prefix_cache(budget - share):
        log.info("prefix caching is off: the %s proposer reads the target's features of the whole prompt",
                 proposer.name)
        return None
    return PrefixCache(share)


@dataclass
class Entry:
    tokens: np.ndarray  # [n] int64: the tokens whose keys and values are held
    k: torch.Tensor  # [layers, kv heads, n, head dim]
    v: torch.Tensor
    last_used: int = 0
    # A hybrid model's recurrent states (models/state_cache.py), by the lengths they follow: a hit starts only
    # at one of these (a state cannot be cut to a shorter prefix as keys can).
    states: dict[int, list] = field(default_factory=dict)
    state_bytes: int = 0  # of one length's states

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + len(self.states) * self.state_bytes

    def usable(self, n: int) -> int:
        """The longest prefix of the n tokens shared with a request that a hit may start from."""
        if not self.state_bytes:
            return n
        return max((b for b in self.states if b <= n), default=0)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (all but each prompt's last, which is always computed)
    hits: int = 0  # of them, tokens found
    requests: int = 0
    request_hits: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def live_prefix(cache: KVCache, row: int, n: int) -> int:
    """The longest of a running row's first n positions a request may start from: all of them, or for a hybrid
    model the longest length whose states the row holds."""
    if not hasattr(cache, "state_lengths"):
        return n
    return max((b for b in cache.state_lengths(row) if b <= n), default=0)


@dataclass
class PrefixCache:
    """The past sequences of one model's KV cache (the target's, or a draft model's), at most
    `capacity_bytes` of keys and values."""

    capacity_bytes: int
    entries: list[Entry] = field(default_factory=list)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    disk: PrefixStore | None = None  # the entries written through to a folder, read back on a miss (prefix_store.py)

    def __post_init__(self):
        self._clock = itertools.count(1)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def cached_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def longest(self, tokens: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest usable prefix with `tokens`, and that prefix's length."""
        ids = np.asarray(tokens, dtype=np.int64)
        best, best_n = None, 0
        for entry in self.entries:
            n = entry.usable(common_prefix(entry.tokens, ids))
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def load(self, tokens: list[int], cache: KVCache, slot: int, count: bool = True,
             live: list[tuple[list[int], int]] = ()) -> int:
        """Copy the longest cached prefix of `tokens` into row `slot` and set its length → that length.
        `tokens` are what the row is about to be fed: the prompt but its last token. `live`: rows of
        sequences still running, (the tokens a row holds, the row), searched too: clients that send one
        system prompt at once share it before the first of them has finished."""
        entry, n = self.longest(tokens)
        ids = np.asarray(tokens, dtype=np.int64)
        shared = max(((live_prefix(cache, row, common_prefix(np.asarray(held, dtype=np.int64), ids)), row)
                      for held, row in live), default=(0, -1))
        if self.disk is not None:
            entry, n = self._from_disk(ids, cache, entry, max(n, shared[0]))
        if shared[0] > n:
            n = shared[0]
            cache.share_prefix(shared[1], [slot], n)
        elif entry is not None:
            entry.last_used = next(self._clock)
            cache.write_row(slot, entry.k[:, :, :n], entry.v[:, :, :n])
            if entry.state_bytes:
                cache.put_state(slot, n, entry.states[n])
        if count:
            self.stats.queries += len(tokens)
            self.stats.hits += n
            self.stats.requests += 1
            self.stats.request_hits += n > 0
        cache.rollback(slot, n)
        return n

    def store(self, tokens: list[int], cache: KVCache, slot: int) -> None:
        """Keep row `slot`'s keys and values of `tokens` (its first len(tokens) positions)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if not len(ids) or self.capacity_bytes <= 0:
            return
        per_token = cache.row_bytes_per_token
        fits = min(len(ids), self.capacity_bytes // per_token)
        if fits == 0:
            return
        states = {}
        if hasattr(cache, "state_at"):  # a hybrid model: only up to the longest length whose states are held
            states = {n: cache.state_at(slot, n) for n in cache.state_lengths(slot) if 0 < n <= fits}
            if not states:
                return
            fits = max(states)
        ids = ids[:fits]
        covering = [e for e in self.entries if common_prefix(e.tokens, ids) == len(ids)]
        if covering:  # already held: as part of this entry, or a longer one
            covering[0].last_used = next(self._clock)
            covering[0].states.update(states)
            return
        # Entries this one extends hold nothing it does not.
        self.entries = [e for e in self.entries if common_prefix(e.tokens, ids) < len(e.tokens)]
        state_bytes = cache.state_bytes if states else 0
        self._evict(fits * per_token + len(states) * state_bytes)
        k, v = cache.read_row(slot, fits)
        self.entries.append(Entry(ids, k, v, next(self._clock), states, state_bytes))
        if self.disk is not None:
            self.disk.put(self.entries[-1])

    def _from_disk(self, ids: np.ndarray, cache: KVCache, entry: Entry | None, n: int) -> tuple[Entry | None, int]:
        """The disk's entry where it holds a longer prefix than memory (`entry`, `n` long) and reads back whole,
        kept in memory from then on; else `entry`, `n`."""
        found, m = self.disk.longest(ids)
        if found is None or not found.worth_reading(m - n):
            return entry, n
        stored = self.disk.read(found)
        if stored is None:
            return entry, n
        read = Entry(stored.tokens, stored.k, stored.v, next(self._clock), stored.states,
                     cache.state_bytes if stored.states else 0)
        if read.nbytes <= self.capacity_bytes:  # else it serves this request only
            self.entries = [e for e in self.entries if common_prefix(e.tokens, read.tokens) < len(e.tokens)]
            self._evict(read.nbytes)
            self.entries.append(read)
        return read, read.usable(common_prefix(read.tokens, ids))

    def _evict(self, need: int) -> None:
        self.entries.sort(key=lambda e: e.last_used)
        total = self.nbytes
        while self.entries and total + need > self.capacity_bytes:
            total -= self.entries.pop(0).nbytes

    def clear(self) -> None:
        self.entries.clear()
