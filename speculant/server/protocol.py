"""Request and response bodies in the OpenAI API's shapes, plus vLLM's usual extensions
(top_k, min_p, stop_token_ids, ignore_eos, return_token_ids) and `speculative_stats`.

Requests are validated strictly (no "16" for 16) with the ranges the OpenAI API documents; fields
this server cannot honour are refused with a 400 naming them, never ignored: declared ones at a
non-neutral value, and any field this server does not know (a vLLM extension it lacks, a typo).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from speculant.config import MAX_LOGPROBS, MAX_TOP_K, SamplingParams

NonEmptyStr = Annotated[str, Field(min_length=1)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share: model, sampling, streaming."""

    # extra="allow" keeps unknown fields, so that unsupported() can name them; the schema says what is refused.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False,
                              json_schema_extra={"additionalProperties": False})

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context length
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    # Accepted only at their neutral value: refusing beats silently ignoring.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, if any."""
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        for name, value in (self.model_extra or {}).items():
            if name not in IGNORED_FIELDS or not (IGNORED_FIELDS[name] is ANY or value in IGNORED_FIELDS[name]):
                return name
        return None

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; n: the chosen token's and the n most likely alternatives'."""
        return None

    def sampling_params(self, choice: int) -> SamplingParams:
        # n choices with one seed must differ yet stay reproducible: choice i uses seed + i.
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + choice, max_tokens=self.max_new_tokens(),
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs_wanted())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


ANY = None
# OpenAI fields that do not change an answer, accepted (and ignored) at these values (ANY: at any value).
IGNORED_FIELDS: dict[str, tuple | None] = {
    "store": (None, False),
    "metadata": ANY,
    "service_tier": ANY,
    "prompt_cache_key": ANY,
    "safety_identifier": ANY,
    "parallel_tool_calls": (None, True, False),
    "tool_choice": (None, "none", "auto"),  # with no tools, both mean plain text
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI API's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_count(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) and self.prompt \
            and not isinstance(self.prompt[0], int) else 1

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, self.n):
            return "best_of"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        # "developer" is the OpenAI API's newer name for "system"; chat templates know only the latter.
        role = "system" if self.role == "developer" else self.role
        content = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(part.text for part in self.content)
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()


# -- responses --------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    """Per-request speculation counters (summed over the request's choices)."""

    method: str | None  # None: plain decoding
    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_acceptance: list[float]
    target_passes: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    speculative_stats: SpeculativeStats | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    speculative_stats: SpeculativeStats | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler) -> dict:
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}, then {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    speculative_stats: SpeculativeStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "speculant"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
