"""The speed-up model of docs/design.md §3 and the target's measured cost curve C_B(T).

    tokens per target pass   E = (1 − α^(k+1)) / (1 − α)
    speed-up                 S = E / (C(k+1)/C(1) + k · c_draft/C(1))

Two measured facts the bare model leaves out are added as `coverage`: a proposer that finds
nothing to draft (n-gram lookup without a match) turns a pass into a plain one, costing C(1)
and yielding one token. With coverage 1 the formula is exactly docs/design.md §3's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speculant.models.llama import Transformer

# A verify pass "costs nothing extra" while C(T)/C(1) stays under this; beyond, drafts cost real time.
MEMORY_BOUND_RATIO = 1.3


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """E = (1 − α^(k+1)) / (1 − α): tokens a target pass yields when each of k drafts is accepted
    with probability α given its predecessors were; E → k + 1 as α → 1."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")
    if 1 - alpha < 1e-9:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: float, cost_ratio: float, draft_cost_ratio: float = 0.0,
                      coverage: float = 1.0, pass_coverage: float | None = None) -> float:
    """S = E / (C(k+1)/C(1) + k·c_draft/C(1)), docs/design.md §3, with E = E(α, k) (see speedup_from)."""
    if k == 0:
        return 1.0
    return speedup_from(expected_tokens_per_pass(alpha, k), k, cost_ratio, draft_cost_ratio, coverage,
                        pass_coverage)


def speedup_from(tokens_per_pass: float, k: float, cost_ratio: float, draft_cost_ratio: float = 0.0,
                 coverage: float = 1.0, pass_coverage: float | None = None) -> float:
    """S = E / (C(k+1)/C(1) + k·c_draft/C(1)) with E, the tokens a drafting pass yields, given;
    cost_ratio = C(k+1)/C(1) and draft_cost_ratio = c_draft/C(1).

    coverage: the share of sequence-steps that carried a draft (1 for a draft model); the others
    yield one token. pass_coverage: the share of target passes that were widened to k + 1 tokens
    (default: coverage; in a batch, one drafting row widens the whole pass).
    """
    widened = coverage if pass_coverage is None else pass_coverage
    tokens = 1 - coverage + coverage * tokens_per_pass
    cost = 1 - widened + widened * cost_ratio + coverage * k * draft_cost_ratio
    return tokens / cost


def monotone(costs: list[float]) -> list[float]:
    """A pass over more tokens never costs less than one over fewer: each C(T) becomes the least
    measured at T or wider. On a shared machine one slowed C(1) would otherwise make every wider pass
    look cheap and speculation look free (seen: an adaptive run drafting at batch 32 and losing half)."""
    out = list(costs)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def fit_alpha(mean_acceptance_length: float, k: float) -> float:
    """The α whose E(α, k) equals a measured mean acceptance length (tokens per drafting pass):
    E is increasing in α, so bisect."""
    target = min(max(mean_acceptance_length, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_pass(mid, k) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# -- the cost curve ------------------------------------------------------------------------------


@dataclass
class CostCurve:
    """C_B(T): the fastest seconds of one target pass over T new tokens per row at batch size B, after
    `context` tokens already cached, logits and target distribution for every position (as a verify pass)."""

    context: int
    seconds: dict[int, list[float]] = field(default_factory=dict)  # B → [C(1), C(2), …]
    _nearest: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.seconds)

    @property
    def max_width(self) -> int:
        return min(len(c) for c in self.seconds.values())

    def _row(self, batch_size: int) -> list[float]:
        """The curve measured at the nearest batch size (geometrically) to the one asked."""
        if batch_size not in self._nearest:  # adaptive k asks every step
            self._nearest[batch_size] = min(self.seconds, key=lambda b: abs(math.log2(b) - math.log2(batch_size)))
        return self.seconds[self._nearest[batch_size]]

    def cost(self, batch_size: int, width: float) -> float:
        """C_B(T) in seconds, linear between measured widths, extrapolated by the last slope."""
        row = self._row(batch_size)
        if width <= 1:
            return row[0]
        lo = min(int(width), len(row) - 1)
        slope = row[lo] - row[lo - 1]
        return row[lo - 1] + slope * (width - lo)

    def ratio(self, batch_size: int, width: float) -> float:
        """C_B(T)/C_B(1)."""
        return self.cost(batch_size, width) / self.cost(batch_size, 1)

    def free_width(self, batch_size: int) -> int:
        """The widest pass that costs at most MEMORY_BOUND_RATIO × C(1) at this batch size."""
        row = self.seconds[batch_size]
        return max(t for t in range(1, len(row) + 1) if row[t - 1] <= MEMORY_BOUND_RATIO * row[0])

    def as_dict(self) -> dict:
        return {"context": self.context, "seconds": {str(b): row for b, row in self.seconds.items()},
                "ratio": {str(b): [c / row[0] for c in row] for b, row in self.seconds.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        return cls(d["context"], {int(b): list(c) for b, c in d["seconds"].items()})


@torch.inference_mode()
def measure_cost_curve(model: Transformer, batch_sizes: list[int], max_width: int = 16, context: int = 256,
                       reps: int = 5, tick: Callable[[], None] | None = None) -> CostCurve:
    """Time one pass over T = 1..max_width new tokens at each batch size, with the target distribution at
    every position (a verify step builds it over [B, T, vocabulary]; left out, widened passes looked
    cheaper than they were). Every batch size and width is measured once per repetition, so a burst of
    other work on a shared machine hits them alike (one batch size after another, a burst could make a
    whole batch size look flat); the fastest of `reps` after a warm-up round (other work only ever adds
    time).

    Widths go from the widest down, and each timed pass follows an untimed one of its shape, as passes
    follow like ones in decoding: a pass timed right after a much wider one is slower than in a row.

    A pass's tokens are distinct: on a model with routed experts (models/moe.py) a pass runs the union of its
    tokens' experts, so repeated tokens would make wide passes look as cheap as narrow ones. Such a model's
    cache is filled by a real prompt pass first, so that its routers see the hidden states decoding gives them;
    a hybrid model's too, so that its recurrent states at `context` exist (models/state_cache.py)."""
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    caches = {b: model.new_cache(b, context + max_width + 1) for b in batch_sizes}
    if model.cfg.n_experts or model.cfg.linear_layers:
        for b, cache in caches.items():
            model(distinct_tokens(vocab, b, context, gen, model.device), cache, torch.arange(b, device=model.device))
    times: dict[int, list[list[float]]] = {b: [[] for _ in range(max_width)] for b in batch_sizes}
    for rep in range(reps + 1):
        for b, cache in caches.items():
            slots = torch.arange(b, device=model.device)
            for t in range(max_width, 0, -1):
                tokens = distinct_tokens(vocab, b, t, gen, model.device)
                for _ in range(2):
                    # Cached keys are never read for their values here: a length is all the timing needs.
                    cache.lengths[:] = context
                    start = time.perf_counter()
                    torch.softmax(model.logits(model(tokens, cache, slots)), dim=-1)
                    if model.device.type == "cuda":
                        torch.cuda.synchronize()
                if rep:  # the first round warms kernels and allocator up
                    times[b][t - 1].append(time.perf_counter() - start)
                if tick:
                    tick()
    return CostCurve(context, {b: monotone([min(ts) for ts in times[b]]) for b in batch_sizes})


def distinct_tokens(vocab: int, batch: int, width: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """[batch, width] random tokens, no two alike where the vocabulary has enough of them."""
    n = batch * width
    if n <= vocab:
        return torch.randperm(vocab, generator=gen)[:n].view(batch, width).to(device)
    return torch.randint(vocab, (batch, width), generator=gen).to(device)
