"""Request and response bodies in the OpenAI API's shapes, plus vLLM's usual extensions
(top_k, min_p, stop_token_ids, ignore_eos, return_token_ids) and `speculative_stats`.

Requests are validated strictly (no "16" for 16) with the ranges the OpenAI API documents; fields
this server cannot honour are refused with a 400 naming them, never ignored: declared ones at a
non-neutral value, and any field this server does not know (a vLLM extension it lacks, a typo).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from speculant.config import MAX_LOGPROBS, MAX_TOP_K, SamplingParams, StructuredOutputsParams
from speculant.server.chat.prompt import tool_mode

NonEmptyStr = Annotated[str, Field(min_length=1)]


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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
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

    def prompt_top_wanted(self) -> int | None:
        """The prompt tokens' log-probabilities: None: none; n: with the n most likely alternatives'."""
        return self.prompt_logprobs

    def sampling_params(self, choice: int, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        # n choices with one seed must differ yet stay reproducible: choice i uses seed + i.
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + choice, max_tokens=self.max_new_tokens(),
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs_wanted(), prompt_logprobs=self.prompt_top_wanted(),
            structured_outputs=structured)

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
    "modalities": (None, ["text"]),
}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # the OpenAI API's default; 0 only to score the prompt (echo)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_top_wanted(self) -> int | None:
        """echo with logprobs scores the prompt as the completion, vLLM's prompt_logprobs as it asks."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None

    def prompt_count(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) and self.prompt \
            and not isinstance(self.prompt[0], int) else 1

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, self.n):
            return "best_of"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


# OpenAI's rule for function names.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)
    name: FunctionName
    arguments: str  # JSON text, as the API sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def for_template(self) -> dict:
        # "developer" is the OpenAI API's newer name for "system"; chat templates know only the latter.
        role = "system" if self.role == "developer" else self.role
        content = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(part.text for part in self.content)
        message = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: FunctionName
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object (a name and its schema)")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True)
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's and llama.cpp's: more variables for the chat template
    enable_thinking: bool | None = None  # the same as chat_template_kwargs' (Qwen3's switch), at the top level

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def functions(self) -> list[dict]:
        """The tools' functions as OpenAI function objects (name, description, parameters)."""
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_mode(self) -> str | None:
        """None (no tools in play), "auto", "required" or the name of the function that must be called;
        raises ValueError naming a tool_choice that cannot be honoured."""
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return tool_mode([t.function.name for t in self.tools or []], named or choice)


# -- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # read from the prefix cache rather than computed


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the thought's, tags included (a reasoning parser is on)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _details_if_any(self, handler) -> dict:
        return without_none(handler(self), "completion_tokens_details")


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
    """The legacy completions shape: parallel lists, one entry per generated token (with echo, per prompt token
    first, the first prompt token's null: nothing predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo]


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: one per token, keyed by its id (the prompt's token and the top n)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _prompt_logprobs_if_any(self, handler) -> dict:
        return without_none(handler(self), "prompt_logprobs")


def without_none(out: dict, *names: str) -> dict:
    """vLLM's extensions leave the body only when asked for."""
    for name in names:
        if out.get(name) is None:
            out.pop(name, None)
    return out


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
    content: str | None
    reasoning_content: str | None = None  # the thought, where a reasoning parser found one
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_if_any(self, handler) -> dict:
        return without_none(handler(self), "tool_calls", "reasoning_content")


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, for the request's one prompt

    @model_serializer(mode="wrap")
    def _prompt_logprobs_if_any(self, handler) -> dict:
        return without_none(handler(self), "prompt_logprobs")


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

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
    prompt_logprobs: PromptLogprobs | None = None  # on the first content chunk, if asked

    @model_serializer(mode="wrap")
    def _prompt_logprobs_if_any(self, handler) -> dict:
        return without_none(handler(self), "prompt_logprobs")


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
