"""Logits → probabilities under a request's transforms, and seeded sampling.

The same function turns target and draft logits into the distributions p and q the verifier
compares: applying the transforms to one side only would break losslessness.

A sampled request's randomness is a set of uniform draws, each a function of the request's key, the
output position whose token it decides and its purpose, never of the batch the request runs in or of how
many drafts a step verifies. Plain decoding draws output token n from uniform(key, n, TOKEN); verification
of deterministic drafts draws the target's token at each draft position from the same uniform and keeps
a draft where it is that token (verify.py), so a seeded request writes the same tokens with speculation
as without, alone or in any batch; a draft model draws a seeded row's drafts that way too (Proposer.draw).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from speculant.config import SamplingParams
from speculant.models import native

if TYPE_CHECKING:
    from speculant.structured.grammar import GrammarState

# The purposes of a request's draws at one position: the token there (plain decoding's draw, and the
# target's under speculation), the acceptance test of a draft model's draft, the draft model's own draw.
TOKEN, ACCEPT, DRAFT = range(3)
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def request_key(seed: int | None) -> int:
    """A sampled request's 64-bit key: from its seed, else from the operating system's randomness."""
    return secrets.randbits(64) if seed is None else _mix64((seed + _GOLDEN) & _MASK)


def uniform(key: int, position: int, purpose: int) -> float:
    """A uniform draw in [0, 1) with 53 random bits, a function of its arguments alone: SplitMix64's
    output function on the key's Weyl sequence (Steele, Lea & Flood 2014), at index 3·position + purpose."""
    index = 3 * position + purpose + 1
    return (_mix64((key + index * _GOLDEN) & _MASK) >> 11) * 2.0 ** -53


def constrained_only(grammars: list[GrammarState | None] | None) -> list[GrammarState | None] | None:
    """A batch's grammars, None where no row has one: every mask path reads None as "all free"."""
    return grammars if grammars and any(g is not None for g in grammars) else None


@dataclass
class SamplingBatch:
    """Per-row sampling transforms of a batch, as tensors, each row's key (None for a greedy row: it
    draws no randomness) and the output position of each row's next token."""

    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B], 0 = off
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    greedy: torch.Tensor  # [B] bool
    keys: list[int | None]
    all_greedy: bool
    # Row b's (temperature, top_k, top_p, min_p), temperature 0 for a greedy row: the native sampler's
    # arguments (verify.TargetTokens).
    transforms: list[tuple[float, int, float, float]]
    positions: list[int]
    # Row b's grammar state (structured output), None for a free row; None for a batch without grammars.
    grammars: list[GrammarState | None] | None = None
    # Whether row b samples from a seed of its own (SamplingParams.seed): its tokens must not depend on k.
    seeded: list[bool] | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], keys: list[int | None], device: torch.device,
              positions: list[int] | None = None,
              grammars: list[GrammarState | None] | None = None) -> SamplingBatch:
        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([1.0 if p.greedy else p.temperature for p in params]),
            top_k=t([max(p.top_k, 0) for p in params], torch.long),
            top_p=t([p.top_p for p in params]),
            min_p=t([p.min_p for p in params]),
            greedy=t([p.greedy for p in params], torch.bool),
            keys=keys,
            all_greedy=all(p.greedy for p in params),
            transforms=[(0.0 if p.greedy else p.temperature, max(p.top_k, 0), p.top_p, p.min_p) for p in params],
            positions=positions or [0] * len(params),
            grammars=constrained_only(grammars),
            seeded=[p.seed is not None and not p.greedy for p in params],
        )

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch restricted to `rows` (those a proposer drafts for); all_greedy stays the whole
        batch's, so drafts report q exactly when the verifier reads it."""
        if rows == list(range(len(self.keys))):
            return self
        at = torch.tensor(rows, device=self.temperature.device)
        return SamplingBatch(self.temperature[at], self.top_k[at], self.top_p[at], self.min_p[at], self.greedy[at],
                             [self.keys[b] for b in rows], self.all_greedy, [self.transforms[b] for b in rows],
                             [self.positions[b] for b in rows],
                             None if self.grammars is None else constrained_only([self.grammars[b] for b in rows]),
                             None if self.seeded is None else [self.seeded[b] for b in rows])

    def is_seeded(self, b: int) -> bool:
        return self.seeded is not None and self.seeded[b]

    def ahead(self, offset: int) -> SamplingBatch:
        """The batch `offset` positions further on: a draft model's draws for its later drafts."""
        return replace(self, positions=[p + offset for p in self.positions])

    def draws(self, purpose: int, offset: int | list[int] = 0) -> list[float | None]:
        """Each row's uniform for `purpose` at the position `offset` (one for all rows, or row b's
        offset[b]) past its next token (None: greedy)."""
        offsets = offset if isinstance(offset, list) else [offset] * len(self.keys)
        return [None if key is None else uniform(key, position + at, purpose)
                for key, position, at in zip(self.keys, self.positions, offsets)]


def constrain(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The grammar's transform, the first of a request's: logits [..., V] with every token `allowed`
    [..., V] forbids at -inf (each row of `allowed` allows some token: structured.grammar.unpack). One
    operation: at a vocabulary's width each costs a thread pool's wake-up."""
    return torch.where(allowed, logits, float("-inf"))


def probabilities(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [B, T, V] → probabilities [B, T, V] after temperature, top-k, top-p, min-p.

    A greedy row becomes the one-hot of its argmax: the acceptance rule applied to one-hot
    distributions is exactly greedy verification, so both share one code path.
    """
    B, T, V = logits.shape
    logits = logits.float()
    if sb.all_greedy:
        return _one_hot_argmax(logits)
    logits = logits / sb.temperature[:, None, None]
    if bool((sb.top_k > 0).any()) or bool((sb.top_p < 1).any()):
        logits = _top_k_top_p(logits, sb.top_k, sb.top_p)
    probs = torch.softmax(logits, dim=-1)
    if bool((sb.min_p > 0).any()):
        floor = sb.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, 0.0, probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(sb.greedy.any()):
        probs = torch.where(sb.greedy[:, None, None], _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits)
    return out.scatter_(-1, argmax(logits)[..., None], 1.0)


ARGMAX_CHUNK = 128


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] → the index of each row's first maximum [...], as torch.argmax gives it.

    On CPU torch.argmax over a vocabulary-wide row is slow (it is not vectorized): the native kernel
    reads the row in one vectorized pass; without it, amax is vectorized: take each 128-wide chunk's
    maximum, the first chunk holding the row's maximum, then the first maximum inside it."""
    if native.argmax_usable(logits):
        return native.argmax_rows(logits)
    V = logits.shape[-1]
    if V % ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    chunks = logits.unflatten(-1, (V // ARGMAX_CHUNK, ARGMAX_CHUNK))  # [..., V/128, 128]
    best = chunks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # [..., 1]
    inside = chunks.gather(-2, best[..., None].expand(*best.shape, ARGMAX_CHUNK)).squeeze(-2)
    return best.squeeze(-1) * ARGMAX_CHUNK + inside.argmax(dim=-1)


# Candidates top-k / top-p look at before sorting the whole vocabulary.
TOP_CANDIDATES = 256


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 n: int | None = None) -> torch.Tensor:
    """logits [B, T, V] with every token outside row b's top-k and top-p set to −inf, read from each
    row's n likeliest tokens (n = V: the whole vocabulary, sorted).

    Sorting a whole vocabulary-wide row costs as much as a small model's pass: by default the likeliest
    TOP_CANDIDATES (or top_k, if more) hold the kept set unless their mass falls short of top_p, then
    the whole rows are read."""
    V = logits.shape[-1]
    n = min(V, max(TOP_CANDIDATES, int(top_k.max()))) if n is None else n
    values, order = logits.topk(n, dim=-1)  # [B, T, n], descending
    rank = torch.arange(n, device=logits.device)
    k = torch.where(top_k > 0, top_k, V)[:, None, None]
    values = values.masked_fill(rank >= k, float("-inf"))
    # The distribution top-p reads: over the top-k tokens where top-k is on, the whole vocabulary where not.
    probs = torch.where(top_k[:, None, None] > 0, torch.softmax(values, dim=-1),
                        torch.softmax(logits, dim=-1).gather(-1, order))
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p[:, None, None]
    short = (mass_before[..., -1:] + probs[..., -1:] < p) & (k > n) & (p < 1)
    if n < V and bool(short.any()):
        return _top_k_top_p(logits, top_k, top_p, V)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does. A row
    # with top_p = 1 drops none (its running sum reaches 1.0 in float32 before the last tokens of a
    # peaked distribution).
    values = values.masked_fill((mass_before >= p) & (rank > 0) & (p < 1), float("-inf"))
    kept = torch.full_like(logits, float("-inf")).scatter_(-1, order, values)
    # A row of a mixed batch with neither transform keeps its whole vocabulary, past the candidates.
    return torch.where(((top_k == 0) & (top_p >= 1))[:, None, None], logits, kept)


def sample(probs: torch.Tensor, draws: list[float | None]) -> torch.Tensor:
    """One token per row of probs [B, V] (each row's sum need not be 1) → [B]; a row whose draw is None
    takes the argmax.

    Inverse CDF (`inverse_cdf`) over the row's running sum in fp64, so that its rounding stays far below
    any probability that matters; a zero-probability token spans an empty interval and is never drawn.
    argmax(p / E) with E ~ Exp(1) is exact too, but drawing a vocabulary of exponentials costs ten times
    the running sum."""
    tokens = argmax(probs)
    for row, u in enumerate(draws):
        if u is not None:
            tokens[row] = inverse_cdf(probs[row].double().cumsum(0), u)
    return tokens


def inverse_cdf(cdf: torch.Tensor, u: float) -> int:
    """The token where u · Σp falls in a row's running sum of probabilities cdf [V]."""
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    # u · Σp rounds up to Σp once in ~2^53 draws: the last token of positive probability.
    return i if i < len(cdf) else int(cdf.argmax())
