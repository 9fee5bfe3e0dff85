"""The Responses API's bodies (POST /v1/responses): input items, tools, text.format, and the Response object
with its output items, in the shapes the OpenAI client reads. Input items keep what the API's own output
items carry (id, status, annotations) so a client may send a response's output back as input."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculant.config import StructuredOutputsParams
from speculant.server.openai.protocol import FunctionName, SamplingRequest


class Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: FunctionName
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def spec(self) -> dict:
        """As chat's tool object (what the chat template and the tool format read)."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type json_schema needs a name and its schema")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.schema_)
        return None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True)
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored (a hint to OpenAI's own models)


class ResponsesRequest(SamplingRequest):
    input: str | list[dict] = Field(min_length=1)  # items are checked one by one (routes.py: input_items)
    instructions: str | None = None
    tools: list[dict] | None = None  # checked in routes.py: only type "function" runs here
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    reasoning: dict | None = None  # accepted and ignored: no effort levels here (a thinking model's thought is
    # kept apart by --reasoning-parser; enable_thinking switches it where the template has the switch)
    chat_template_kwargs: dict | None = None  # as chat's (vLLM's)
    enable_thinking: bool | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1)
    # Accepted at their neutral values (what OpenAI's clients send by default), refused at any other.
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Extra output the client asks for (the Agents SDK always sends the field): only what needs nothing is
    # accepted, "reasoning.encrypted_content" (a reasoning item's text is already in the clear here).
    include: list[str] | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "n"
        if any(value not in INCLUDABLE for value in self.include or []):
            return "include"
        if self.truncation == "auto":
            return "truncation"
        if self.background:
            return "background"
        if self.top_logprobs:
            return "top_logprobs"
        return super().unsupported()


INCLUDABLE = ("reasoning.encrypted_content",)


# -- the Response object ----------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A thinking model's thought (chat/reasoning.py), as OpenAI and vLLM write it: no summary, its text as content."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    incomplete_details: IncompleteDetails | None = None
    error: dict | None = None
    usage: ResponseUsage | None = None
    speculative_stats: Any = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
