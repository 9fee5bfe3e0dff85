"""What the audit compares and which requests it may audit.

A request is auditable when plain decoding reproduces it: greedy, or sampled with a seed (a seeded row draws
plain decoding's tokens with every proposer, docs/design.md §2). Unseeded sampling has no single right answer,
and a setting whose name says "lossy" promises none: both are skipped, and counted as such."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace

from speculant.config import SamplingParams

LOSSY = "lossy"


def sampled(request_id: str, rate: float) -> bool:
    """Whether a request is audited at `rate`: decided by a hash of its id, so a request id is always in or
    always out (a replica, a replay and a test agree), and ids drawn at random give the rate."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h < rate * 2**64


def lossy_settings(settings: object, prefix: str = "") -> list[str]:
    """The names (dotted where nested) of the settings in a mapping or dataclass whose name contains "lossy"
    and that are set (any true value): a lossy variant may exist only behind such a name (docs/design.md §2)."""
    if is_dataclass(settings) and not isinstance(settings, type):
        settings = {f.name: getattr(settings, f.name) for f in fields(settings)}
    if not isinstance(settings, Mapping):
        return []
    found = []
    for name, value in settings.items():
        path = f"{prefix}{name}"
        if LOSSY in str(name).lower() and value:
            found.append(path)
        elif isinstance(value, Mapping) or (is_dataclass(value) and not isinstance(value, type)):
            found += lossy_settings(value, path + ".")
    return found


def skip_reason(params: SamplingParams, lossy: list[str] | tuple[str, ...] = ()) -> str | None:
    """Why a request cannot be audited ("lossy", "unseeded"), or None. `lossy`: the lossy settings in force
    beyond the request's own sampling parameters (the engine's, the request body's)."""
    if lossy or lossy_settings(params):
        return "lossy"
    if not params.greedy and params.seed is None:
        return "unseeded"
    return None


def plain_params(params: SamplingParams, n_tokens: int) -> SamplingParams:
    """The sampling parameters of the audit's re-decode: the request's own (temperature, top-k/p, min-p, seed,
    stop strings and tokens, grammar), at most as many tokens as it wrote, no log-probabilities (they change no
    token)."""
    return replace(params, max_tokens=max(1, n_tokens), logprobs=None, prompt_logprobs=None)


@dataclass(frozen=True)
class Difference:
    """The first output position where two decodings part; a token None: that decoding had ended."""

    position: int
    speculative: int | None
    plain: int | None

    def describe(self) -> str:
        def token(t: int | None) -> str:
            return "(ended)" if t is None else str(t)

        return (f"first differing output position {self.position}: speculative token {token(self.speculative)}, "
                f"plain token {token(self.plain)}")


def first_difference(speculative: list[int], plain: list[int]) -> Difference | None:
    """Where `plain` first differs from `speculative` (lengths included); None where they are the same."""
    for i, (a, b) in enumerate(zip(speculative, plain)):
        if a != b:
            return Difference(i, a, b)
    if len(speculative) == len(plain):
        return None
    n = min(len(speculative), len(plain))
    return Difference(n, speculative[n] if n < len(speculative) else None, plain[n] if n < len(plain) else None)


def describe_path(engine) -> str:
    """How an engine computes: dtype, weights, kernel level, device (what a mismatch report names)."""
    from speculant.models import native

    dtype = str(engine.model.dtype).removeprefix("torch.")
    kernels = native.level() if engine.device.type == "cpu" else engine.device.type
    return f"{dtype}, weights {engine.target.quantization or 'none'}, kernels {kernels}"
