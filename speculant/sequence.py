"""A request in flight: its tokens, sampling state, text and statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from speculant.config import SamplingParams
from speculant.errors import SpeculantError
from speculant.models.tokenizer import Detokenizer

if TYPE_CHECKING:
    from speculant.structured.grammar import GrammarState


@dataclass
class SpecStats:
    """Speculation counters; the same shape serves one request and the whole engine."""

    num_drafts: int = 0  # verify steps that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafts_per_pos: list[int] = field(default_factory=list)
    target_passes: int = 0

    def record(self, n_draft: int, n_accepted: int) -> None:
        self.target_passes += 1
        if n_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += n_draft
        self.num_accepted_tokens += n_accepted
        grow = n_draft - len(self.drafts_per_pos)
        if grow > 0:
            self.drafts_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for pos in range(n_draft):
            self.drafts_per_pos[pos] += 1
            self.accepted_per_pos[pos] += pos < n_accepted

    def __add__(self, other: SpecStats) -> SpecStats:
        return self._combine(other, 1)

    def __sub__(self, other: SpecStats) -> SpecStats:
        """The counts since `other`, an earlier snapshot of the same counters."""
        return self._combine(other, -1)

    def _combine(self, other: SpecStats, sign: int) -> SpecStats:
        n = max(len(self.drafts_per_pos), len(other.drafts_per_pos))

        def per_pos(a: list[int], b: list[int]) -> list[int]:
            a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
            return [x + sign * y for x, y in zip(a, b)]

        return SpecStats(self.num_drafts + sign * other.num_drafts,
                         self.num_draft_tokens + sign * other.num_draft_tokens,
                         self.num_accepted_tokens + sign * other.num_accepted_tokens,
                         per_pos(self.accepted_per_pos, other.accepted_per_pos),
                         per_pos(self.drafts_per_pos, other.drafts_per_pos),
                         self.target_passes + sign * other.target_passes)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafts_per_pos)]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "target_passes": self.target_passes,
        }


@dataclass
class TokenLogprob:
    """log p(token) under the target's raw distribution (before the sampling transforms, as
    vLLM and the OpenAI API report it), and the `n` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1 + the tokens more likely than this one (vLLM's prompt_logprobs report it)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, capped by the context length
    key: int | None  # its random draws' key (sampling.request_key); None: greedy
    detokenizer: Detokenizer | None
    tokens: list[int] = field(default_factory=list)  # prompt + output
    slot: int = -1  # row in the target's KV cache
    num_cached: int = 0  # tokens the target's cache holds for this sequence
    cached_tokens: int = 0  # of the prompt, tokens read from the prefix cache rather than computed
    text: str = ""
    emitted: int = 0  # characters of text already streamed out
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    # One per prompt token, the first None (nothing predicts it), if asked; set once the prompt is fed.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, where one did (Anthropic's stop_sequence)
    stats: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar: GrammarState | None = None  # structured output: the grammar after the committed tokens
    speculate: bool = True  # False: decoded plainly (k = 0) whatever the engine's proposer, as the audit's re-decode
    # Background work (the audit's): a row only live traffic does not need, paused while a live prompt is fed,
    # given up when live requests wait for its row (scheduler.py).
    background: bool = False

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> dict:
        end = self.finish_time or time.perf_counter()
        decode_s = end - (self.first_token_time or end)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": self.num_generated,
            "time_to_first_token_s": (self.first_token_time - self.arrival) if self.first_token_time else None,
            "total_time_s": end - self.arrival,
            "tokens_per_s": (self.num_generated - 1) / decode_s if decode_s > 0 else None,
            **self.stats.as_dict(),
        }


def check_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Refuse a prompt the model cannot take: empty, a token outside its vocabulary, no room left to generate."""
    if not prompt_ids:
        raise SpeculantError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise SpeculantError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise SpeculantError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                             f"{max_model_len} (prompt plus at least one generated token)")
