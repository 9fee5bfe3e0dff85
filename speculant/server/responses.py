"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API over chat's machinery.

A request's input items (messages, function calls, their outputs) become chat messages, after the conversation
of its previous_response_id where it names one; the whole goes through the chat template as a chat completion
does, so a continued conversation's prompt starts with the one before it and its keys come from the prefix
cache. Tools, tool_choice and text.format are chat's (completions.py: the same tool prompt, the same grammars,
exact under speculation). Only `function` tools run here: other types are refused with a 400 naming them.
Stored responses live in memory (store.py), bounded in count and age; `store: false` keeps nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from speculant.server.completions import chat_prompt, structured_output
from speculant.server.core import OpenAIServer
from speculant.server.http import ERROR_RESPONSES, APIError, api_error, parse_body
from speculant.server.protocol import tool_mode
from speculant.server.responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    NamedFunctionChoice,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from speculant.server.store import Stored
from speculant.server.worker import Delta, EngineFailure, RequestStream, RequestTimedOut, ShuttingDown
from speculant.structured.tools import ToolCallStream, ToolFormat, tool_format

router = APIRouter()


def stored(server: OpenAIServer, rid: str, param: str | None = None) -> Stored:
    entry = server.responses.get(rid)
    if entry is None:
        raise APIError(404, f"no response with id '{rid}' is stored on this server (never stored, or expired)",
                       param=param, code="response_not_found")
    return entry


# -- input ------------------------------------------------------------------------------------


def input_items(value: str | list[dict]) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message" if "role" in raw else None)
        model = {"message": MessageItem, "function_call": FunctionCallItem,
                 "function_call_output": FunctionCallOutputItem}.get(kind)
        if model is None:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported here (message, "
                                f"function_call and function_call_output are)", param=f"input[{i}]")
        try:
            items.append(model.model_validate(raw))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise APIError(400, f"input[{i}].{where}: {first['msg']}", param=f"input[{i}]") from None
    return items


def as_messages(items: list, earlier: list[dict]) -> list[dict]:
    """Input items → chat messages following `earlier`; a function call joins the assistant turn before it (one
    answer's calls), a function_call_output must answer a call made before it."""
    out: list[dict] = []
    calls = {c["id"] for m in earlier for c in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise APIError(400, f"input[{i}]: function_call_output answers call_id '{item.call_id}', which no "
                                    f"function_call before it made", param=f"input[{i}]")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def function_tools(tools: list[dict] | None) -> list[FunctionTool]:
    others = sorted({str(t.get("type")) for t in tools or [] if t.get("type") != "function"})
    if others:
        raise APIError(400, f"tools of type {', '.join(repr(t) for t in others)} are not supported by this server: "
                            f"only 'function' tools run here", param="tools")
    try:
        return [FunctionTool.model_validate(t) for t in tools or []]
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"tools: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
                       param="tools") from None


# -- output -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(text: str, tools: ToolFormat | None) -> tuple[list, list[dict]]:
    """An answer → (its output items: a message where it wrote text, a function_call per call; its calls as
    chat tool_calls)."""
    parsed = tools.parse(text) if tools is not None else None
    content, calls = parsed if parsed is not None else (text, [])
    items: list = []
    if content:
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=content)]))
    items += [OutputFunctionCall(id=new_id("fc"), call_id=c["id"], name=c["function"]["name"],
                                 arguments=c["function"]["arguments"]) for c in calls]
    return items, calls


@dataclass
class Run:
    """One request's run: what the Response object and the store need besides the answer."""

    rid: str
    req: ResponsesRequest
    messages: list[dict]  # the conversation before the answer
    tools: ToolFormat | None  # the tool format, where tools are in play
    prompt_tokens: int

    def response(self, server: OpenAIServer, status: str = "completed", output: list | None = None,
                 usage: ResponseUsage | None = None, finish: str | None = None) -> ResponseObject:
        req = self.req
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice) \
            else req.tool_choice or "auto"
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        incomplete = status == "completed" and finish == "length"
        return ResponseObject(
            id=self.rid, model=server.model_name, status="incomplete" if incomplete else status,
            output=output or [], instructions=req.instructions, tools=req.tools or [], tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls, temperature=req.temperature, top_p=req.top_p,
            max_output_tokens=req.max_output_tokens, previous_response_id=req.previous_response_id,
            text={"format": text_format}, metadata=req.metadata or {}, store=req.store, usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None)

    def usage(self, stream: RequestStream, output_tokens: int) -> ResponseUsage:
        cached = stream.seqs[0].cached_tokens
        return ResponseUsage(input_tokens=self.prompt_tokens, output_tokens=output_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=cached),
                             total_tokens=self.prompt_tokens + output_tokens)

    def finish(self, server: OpenAIServer, stream: RequestStream, answer: Delta) -> ResponseObject:
        items, calls = output_items(answer.text, self.tools)
        response = self.response(server, output=items, usage=self.usage(stream, len(answer.token_ids)),
                                 finish=answer.finish_reason)
        response.speculative_stats = server.speculative_stats(stream.seqs).model_dump()
        if self.req.store:
            content = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
            said = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            server.responses.put(self.rid, response.model_dump(), self.messages + [said])
        return response


# -- the routes -------------------------------------------------------------------------------


@router.post("/v1/responses", responses=ERROR_RESPONSES, response_model=ResponseObject)
async def create_response(request: Request) -> Response:
    server: OpenAIServer = request.app.state.server
    req = await parse_body(request, ResponsesRequest)
    server.check_model(req.model)
    server.need_chat_template("input")
    tools = function_tools(req.tools)
    earlier = stored(server, req.previous_response_id, "previous_response_id").messages \
        if req.previous_response_id else []
    messages = earlier + as_messages(input_items(req.input), earlier)
    choice = req.tool_choice.name if isinstance(req.tool_choice, NamedFunctionChoice) else req.tool_choice
    try:
        mode = tool_mode([t.name for t in tools], choice)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    fmt = tool_format(server.tokenizer.chat_template)
    specs = [t.spec() for t in tools]
    wanted = req.text.format.structured() if req.text and req.text.format else None
    structured = await structured_output(server, wanted, mode, [s["function"] for s in specs], req.parallel_tool_calls,
                                         fmt, "text.format")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    ids = await chat_prompt(server, system + messages, mode, specs, fmt, "input")
    server.check_context(ids, req.max_new_tokens(), "input")
    server.check_work([ids], req)
    run = Run(new_id("resp"), req, messages, fmt if mode else None, len(ids))
    stream = await server.start(run.rid, req, [ids], structured, request)
    if req.stream:
        return StreamingResponse(stream_events(server, run, stream), media_type="text/event-stream",
                                 background=BackgroundTask(stream.close))
    answers = await server.collect(request, stream, req)
    if answers is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(run.finish(server, stream, answers[0]).model_dump())


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES, response_model=ResponseObject)
def get_response(request: Request, response_id: str) -> JSONResponse:
    return JSONResponse(stored(request.app.state.server, response_id).response)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES, response_model=DeletedResponse)
def delete_response(request: Request, response_id: str) -> DeletedResponse:
    server: OpenAIServer = request.app.state.server
    stored(server, response_id)
    server.responses.delete(response_id)
    return DeletedResponse(id=response_id)


# -- streaming --------------------------------------------------------------------------------


class Events:
    """Server-sent events as the OpenAI client's responses.stream() reads them, numbered in order."""

    def __init__(self):
        self.number = 0

    def __call__(self, type: str, **fields) -> str:
        body = {"type": type, "sequence_number": self.number,
                **{k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}}
        self.number += 1
        return f"event: {type}\ndata: {JSONResponse(body).body.decode()}\n\n"


async def stream_events(server: OpenAIServer, run: Run, stream: RequestStream) -> AsyncIterator[str]:
    """response.created, .in_progress; the text as one message item (its deltas streamed while no call may be
    starting: ToolCallStream); then a function_call item per call; response.completed."""
    event, index = Events(), 0
    yield event("response.created", response=run.response(server, "in_progress"))
    yield event("response.in_progress", response=run.response(server, "in_progress"))
    text_stream = ToolCallStream(run.tools) if run.tools is not None else None
    message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
    answer = Delta(0, [], "", None)
    sent = ""

    def open_message() -> list[str]:
        return [event("response.output_item.added", output_index=0, item=message),
                event("response.content_part.added", item_id=message.id, output_index=0, content_index=0,
                      part=OutputText(text=""))]

    try:
        async for d in stream:
            answer.text += d.text
            answer.token_ids += d.token_ids
            answer.finish_reason = d.finish_reason
            piece = text_stream.push(d.text) if text_stream is not None else d.text
            if d.finish_reason is not None and text_stream is not None:
                piece += text_stream.finish()[0]
            if not piece:
                continue
            if not sent:
                for e in open_message():
                    yield e
            sent += piece
            yield event("response.output_text.delta", item_id=message.id, output_index=0, content_index=0,
                        delta=piece, logprobs=[])
    except (ShuttingDown, EngineFailure, RequestTimedOut) as e:
        error = api_error(e, run.rid).info
        yield event("error", code=error.code, message=error.message, param=error.param)
        stream.close()
        return
    finally:
        stream.close()
    final = run.finish(server, stream, answer)
    # The final items, with the streamed message's id: what was streamed is what response.completed holds.
    items = [i for i in final.output if not isinstance(i, OutputMessage)]
    if sent:
        done = OutputText(text=sent.strip() if run.tools is not None else sent)
        message.content, message.status = [done], "completed"
        yield event("response.output_text.done", item_id=message.id, output_index=0, content_index=0,
                    text=done.text, logprobs=[])
        yield event("response.content_part.done", item_id=message.id, output_index=0, content_index=0, part=done)
        yield event("response.output_item.done", output_index=0, item=message)
        items.insert(0, message)
        index = 1
    for call in items[index:]:
        yield event("response.output_item.added", output_index=index,
                    item=call.model_copy(update={"arguments": "", "status": "in_progress"}))
        yield event("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                    delta=call.arguments)
        yield event("response.function_call_arguments.done", item_id=call.id, output_index=index,
                    name=call.name, arguments=call.arguments)
        yield event("response.output_item.done", output_index=index, item=call)
        index += 1
    final.output = items
    if run.req.store:  # the stored copy holds the streamed ids
        server.responses.entries[run.rid].response = final.model_dump()
    yield event("response.completed", response=final)

