"""A Messages API answer's content blocks, stop reason and usage, from the engine's text (shared by the whole
answer, routes.py, and the streamed one, stream.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from speculant.config import StructuredOutputsParams
from speculant.server.bridge.core import OpenAIServer
from speculant.server.bridge.worker import Delta, RequestStream
from speculant.server.chat.reasoning import ReasoningParser
from speculant.server.messages.protocol import Message, MessagesRequest, OutText, OutThinking, OutToolUse, Usage
from speculant.structured.tools import ToolFormat, json_value


@dataclass
class Prompt:
    """A request's prompt, and what reading its answer needs."""

    ids: list[int]
    tools: ToolFormat | None  # the tool format, where tools are in play
    structured: StructuredOutputsParams | None  # a forced call's grammar
    reasoning: ReasoningParser | None


def tool_uses(calls: list[dict]) -> list[OutToolUse]:
    """Chat's tool_calls as tool_use blocks, their input the arguments' JSON as the model wrote it."""
    return [OutToolUse(id=f"toolu_{uuid.uuid4().hex[:24]}", name=c["function"]["name"],
                       input=json_value(c["function"]["arguments"])) for c in calls]


def stop_reason(stream: RequestStream, finish: str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) as Anthropic names why an answer ended."""
    matched = stream.seqs[0].stop_string
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def usage(p: Prompt, stream: RequestStream, output_tokens: int) -> Usage:
    cached = stream.seqs[0].cached_tokens
    return Usage(input_tokens=len(p.ids) - cached, output_tokens=output_tokens, cache_read_input_tokens=cached)


def cut_call(p: Prompt, finish: str | None) -> bool:
    """A forced call cut by max_tokens: its text is no call, and no answer either (left out, not sent as text)."""
    return p.tools is not None and p.structured is not None and finish == "length"


def answer(server: OpenAIServer, req: MessagesRequest, p: Prompt, stream: RequestStream, d: Delta) -> Message:
    thought, text, _ = p.reasoning.split(d.text) if p.reasoning is not None else (None, d.text, 0)
    parsed = p.tools.parse(text) if p.tools is not None else None
    text, calls = parsed if parsed is not None else ("" if cut_call(p, d.finish_reason) else text, [])
    content: list = [OutThinking(thinking=thought)] if thought is not None else []
    content += ([OutText(text=text)] if text else []) + tool_uses(calls)
    reason, matched = stop_reason(stream, d.finish_reason, bool(calls))
    return Message(id=stream.request_id, model=server.model_name, content=content, stop_reason=reason,
                   stop_sequence=matched, usage=usage(p, stream, len(d.token_ids)),
                   speculative_stats=server.speculative_stats(stream.seqs).model_dump())
