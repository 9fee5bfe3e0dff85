"""Anthropic's Messages API bodies (POST /v1/messages, /v1/messages/count_tokens) in the shapes the `anthropic`
SDK sends and reads.

Validated strictly, as Anthropic validates them: an unknown field is a 400 naming it. Content blocks are checked
one by one (routes.py), so an image or a document is refused with a 400 that names the block, not a union error.
`cache_control` is accepted anywhere and ignored: every prompt's prefix is cached here without being asked.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from speculant.config import MAX_TOP_K, SamplingParams, StructuredOutputsParams
from speculant.server.openai.protocol import FunctionName

NonEmptyStr = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Block(Strict):
    cache_control: dict | None = None


class TextBlock(Block):
    type: Literal["text"]
    text: str
    citations: list | None = None  # accepted as sent back: a text block's own field


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: FunctionName
    input: dict
    # As an answer's tool_use block carries them, sent back: who called and which toolset (null here).
    caller: dict | None = None
    toolset_name: str | None = None


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] = ""
    is_error: bool = False
    toolset_name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(Block):
    """An earlier answer's thought, sent back: left out of the prompt, as chat templates leave past thoughts."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict]  # blocks checked one by one (routes.py: blocks)


class Tool(Block):
    type: Literal["custom"] | None = None  # server tools (web search, code execution…) are refused in routes.py
    name: FunctionName
    description: str | None = None
    input_schema: dict
    # Accepted and ignored: a forced call follows the schema exactly whatever `strict` says, and the input is
    # sent whole once the call is complete.
    strict: bool | None = None
    eager_input_streaming: bool | None = None

    def spec(self) -> dict:
        """As chat's tool object (what the chat template and the tool format read)."""
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool = False

    def mode(self) -> str:
        """As chat's tool_choice: "auto", "required", "none" or the tool's name."""
        if self.type == "tool":
            if self.name is None:
                raise ValueError("tool_choice of type 'tool' needs the tool's name")
            return self.name
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    # Checked as Anthropic checks it, not enforced: the thought ends where the model ends it, within max_tokens.
    budget_tokens: int | None = Field(None, ge=1)
    display: str | None = None


class Metadata(Strict):
    user_id: str | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    effort: str | None = None  # accepted and ignored: no effort levels here (as the Responses API's reasoning)
    format: JsonOutputFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        return None if self.format is None else StructuredOutputsParams(json=self.format.schema_)


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: what the prompt is made of."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict] | None = None  # checked in routes.py: only custom tools run here
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Hints to Anthropic's own fleet and prompt caching, which change no answer: accepted and ignored (every
    # prompt's prefix is cached here unasked).
    cache_control: dict | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n\n".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float = Field(1.0, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)  # temperature, top_p, top_k: older SDKs' fields
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # a hint to Anthropic's own fleet: nothing here

    # What the shared engine bridge reads of a request (bridge/core.py), in its terms.
    n: ClassVar[int] = 1
    return_token_ids: ClassVar[bool] = False
    include_usage: ClassVar[bool] = False

    def max_new_tokens(self) -> int:
        return self.max_tokens

    def top_logprobs_wanted(self) -> None:
        return None

    def sampling_params(self, choice: int, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=-1 if not self.top_k else self.top_k,
                              top_p=1.0 if self.top_p is None else self.top_p, max_tokens=self.max_tokens,
                              stop=self.stop_sequences or None, structured_outputs=structured)


# -- the answer -------------------------------------------------------------------------------


class OutText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutThinking(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing to sign: the thought is in the clear, and sent back it is left out


class OutToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any


class Usage(BaseModel):
    """Anthropic's counts: input_tokens are the prompt's tokens computed, cache_read_input_tokens those read from
    the prefix cache (their sum is the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutThinking | OutText | OutToolUse]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: Usage
    speculative_stats: Any = None


class TokenCount(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error… (http/guard.py)
    message: str


class ErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
