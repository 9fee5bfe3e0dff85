"""POST /tokenize and POST /detokenize's bodies, in vLLM's shapes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from speculant.server.openai.protocol import ChatMessage, ToolSpec


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or messages through the chat template."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # for a prompt: the BOS token where the model wants one
    tools: list[ToolSpec] | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
