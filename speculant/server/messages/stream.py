"""A Messages API answer streamed as the `anthropic` SDK's messages.stream() reads it.

message_start, ping; then each content block in order: content_block_start, its deltas (thinking_delta,
text_delta, input_json_delta), content_block_stop; message_delta (stop_reason, stop_sequence, usage) and
message_stop. A thought streams as a thinking block (held back where a tag may be starting: reasoning.py), the
text as one text block while no call may be starting (ToolCallStream), then a tool_use block per call, its
input whole in one delta. An engine error after the headers travels as an `error` event, which the SDK raises.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from speculant.server.bridge.core import OpenAIServer
from speculant.server.bridge.worker import EngineFailure, RequestStream, RequestTimedOut, ShuttingDown
from speculant.server.http.errors import api_error
from speculant.server.http.guard import anthropic_error
from speculant.server.messages.answer import Prompt, cut_call, stop_reason, tool_uses, usage
from speculant.server.messages.protocol import Message, MessagesRequest, Usage
from speculant.structured.tools import ToolCallStream


def event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {JSONResponse({'type': kind, **fields}).body.decode()}\n\n"


class Blocks:
    """The content blocks opened so far: one open at a time, numbered in the order they opened."""

    def __init__(self):
        self.count = 0
        self.open_kind: str | None = None

    def start(self, kind: str, block: dict) -> list[str]:
        out = self.stop()
        self.open_kind = kind
        out.append(event("content_block_start", index=self.count, content_block=block))
        return out

    def delta(self, kind: str, block: dict, delta: dict) -> list[str]:
        """A delta of a block of `kind`, opening it first where another kind (or none) is open."""
        out = self.start(kind, block) if self.open_kind != kind else []
        return out + [event("content_block_delta", index=self.count, delta=delta)]

    def stop(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        self.count += 1
        return [event("content_block_stop", index=self.count - 1)]


async def stream_events(server: OpenAIServer, req: MessagesRequest, p: Prompt,
                        stream: RequestStream) -> AsyncIterator[str]:
    opening = Message(id=stream.request_id, model=server.model_name, content=[],
                      usage=Usage(input_tokens=len(p.ids), output_tokens=0))
    yield event("message_start", message=opening.model_dump(exclude={"speculative_stats"}))
    yield event("ping")
    splitter = p.reasoning.splitter() if p.reasoning is not None else None
    text_stream = ToolCallStream(p.tools) if p.tools is not None else None
    out, ids, finish, calls = Blocks(), [], None, []
    try:
        async for d in stream:
            ids += d.token_ids
            finish = d.finish_reason
            thought, text = splitter.push(d.text) if splitter is not None else ("", d.text)
            if finish is not None and splitter is not None:
                more_thought, more_text = splitter.finish()
                thought, text = thought + more_thought, text + more_text
            if thought or (splitter is not None and splitter.thought and out.count == 0 and out.open_kind is None):
                # The thinking block opens with the thought, even an empty one.
                for e in out.delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                   {"type": "thinking_delta", "thinking": thought}):
                    yield e
            piece = text_stream.push(text) if text_stream is not None else text
            if finish is not None and text_stream is not None:
                rest, calls = text_stream.finish()
                piece += "" if not calls and cut_call(p, finish) else rest
            if piece:
                for e in out.delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": piece}):
                    yield e
    except (ShuttingDown, EngineFailure, RequestTimedOut) as e:
        error = api_error(e, stream.request_id)
        yield event("error", error=anthropic_error(error.status, error.info.message)["error"])
        return
    finally:
        stream.close()
    for e in out.stop():
        yield e
    blocks = tool_uses(calls)
    for block in blocks:
        yield event("content_block_start", index=out.count, content_block={**block.model_dump(), "input": {}})
        yield event("content_block_delta", index=out.count,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block.input, ensure_ascii=False)})
        yield event("content_block_stop", index=out.count)
        out.count += 1
    reason, matched = stop_reason(stream, finish, bool(blocks))
    used = usage(p, stream, len(ids))
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": matched},
                usage=used.model_dump(), speculative_stats=server.speculative_stats(stream.seqs).model_dump())
    yield event("message_stop")
