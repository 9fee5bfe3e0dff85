"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API over chat's machinery.

A request's input items (messages, function calls, their outputs) become chat messages, after the conversation
of its previous_response_id where it names one; the whole goes through the chat template as a chat completion
does, so a continued conversation's prompt starts with the one before it and its keys come from the prefix
cache. Tools, tool_choice and text.format are chat's (chat/prompt.py: the same tool prompt, the same grammars,
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

from speculant.server.bridge.core import OpenAIServer
from speculant.server.bridge.worker import Delta, EngineFailure, RequestStream, RequestTimedOut, ShuttingDown
from speculant.server.chat.prompt import chat_prompt, request_template_kwargs, structured_output, tool_mode
from speculant.server.chat.reasoning import ReasoningParser, reasoning_tokens
from speculant.server.http.errors import ERROR_RESPONSES, APIError, api_error, parse_body
from speculant.server.responses.protocol import (
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
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from speculant.server.responses.store import Stored
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
        if kind == "reasoning":
            continue  # an earlier answer's thought sent back: chat templates leave past thoughts out too
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


def output_items(text: str, tools: ToolFormat | None, thought: str | None = None, forced: bool = False,
                 finish: str | None = None) -> tuple[list, list[dict]]:
    """An answer (its thought apart, where it had one) → (its output items: a reasoning item where it thought, a
    message where it wrote text, `incomplete` where max_output_tokens cut it, a function_call per call; its calls
    as chat tool_calls). A `forced` call cut short is no call and no text: left out, not sent as raw markup."""
    parsed = tools.parse(text) if tools is not None else None
    content, calls = parsed if parsed is not None else ("" if forced and finish == "length" else text, [])
    items: list = []
    if thought is not None:
        items.append(OutputReasoning(id=new_id("rs"), content=[ReasoningText(text=thought)]))
    if content:
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=content)],
                                   status="incomplete" if finish == "length" else "completed"))
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
    reasoning: ReasoningParser | None  # where the model's thought is kept apart
    forced: bool = False  # tool_choice requires a call: the answer's grammar is a call's

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

    def usage(self, stream: RequestStream, output_tokens: int, reasoning_tokens: int) -> ResponseUsage:
        cached = stream.seqs[0].cached_tokens
        return ResponseUsage(input_tokens=self.prompt_tokens, output_tokens=output_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=cached),
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                             total_tokens=self.prompt_tokens + output_tokens)

    def finish(self, server: OpenAIServer, stream: RequestStream, answer: Delta) -> ResponseObject:
        thought, text, end = self.reasoning.split(answer.text) if self.reasoning is not None else (None, answer.text, 0)
        items, calls = output_items(text, self.tools, thought, self.forced, answer.finish_reason)
        thought_tokens = reasoning_tokens(answer.token_ids, end, server.tokenizer.decode)
        response = self.response(server, output=items, usage=self.usage(stream, len(answer.token_ids), thought_tokens),
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
    if req.max_tokens is not None:  # SamplingRequest's field, chat's name: refused rather than ignored
        raise APIError(400, "max_tokens is not a Responses API field: send max_output_tokens", param="max_tokens")
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
    kwargs = request_template_kwargs(req.chat_template_kwargs, req.enable_thinking)
    ids = await chat_prompt(server, system + messages, mode, specs, fmt, "input", template_kwargs=kwargs)
    server.check_context(ids, req.max_new_tokens(), "input")
    server.check_work([ids], req)
    run = Run(new_id("resp"), req, messages, fmt if mode else None, len(ids), server.reasoning_for(ids, structured),
              forced=mode not in (None, "auto"))
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
    """response.created, .in_progress; a thought as a reasoning item (its deltas streamed, held back where a
    tag may be starting: chat/reasoning.py); the text as one message item (its deltas streamed while no call may be
    starting: ToolCallStream); then a function_call item per call; response.completed, or response.incomplete
    where max_output_tokens cut the answer."""
    event, out = Events(), StreamedItems()
    yield event("response.created", response=run.response(server, "in_progress"))
    yield event("response.in_progress", response=run.response(server, "in_progress"))
    splitter = run.reasoning.splitter() if run.reasoning is not None else None
    text_stream = ToolCallStream(run.tools) if run.tools is not None else None
    answer = Delta(0, [], "", None)
    try:
        async for d in stream:
            answer.text += d.text
            answer.token_ids += d.token_ids
            answer.finish_reason = d.finish_reason
            thought, text = splitter.push(d.text) if splitter is not None else ("", d.text)
            if d.finish_reason is not None and splitter is not None:
                more_thought, more_text = splitter.finish()
                thought, text = thought + more_thought, text + more_text
            if splitter is not None and splitter.thought:
                for e in out.think(event, thought):
                    yield e
            piece = text_stream.push(text) if text_stream is not None else text
            if d.finish_reason is not None and text_stream is not None:
                rest, calls = text_stream.finish()
                piece += "" if not calls and run.forced and d.finish_reason == "length" else rest
            if piece:
                for e in out.say(event, piece):
                    yield e
    except (ShuttingDown, EngineFailure, RequestTimedOut) as e:
        error = api_error(e, run.rid).info
        yield event("error", code=error.code, message=error.message, param=error.param)
        stream.close()
        return
    finally:
        stream.close()
    final = run.finish(server, stream, answer)
    for e in out.close_thought(event):
        yield e
    for e in out.close_message(event, run.tools is not None, answer.finish_reason):
        yield e
    # The final items, with the streamed items' ids: what was streamed is what response.completed holds.
    items = out.items()
    for call in [i for i in final.output if isinstance(i, OutputFunctionCall)]:
        index = len(items)
        yield event("response.output_item.added", output_index=index,
                    item=call.model_copy(update={"arguments": "", "status": "in_progress"}))
        yield event("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                    delta=call.arguments)
        yield event("response.function_call_arguments.done", item_id=call.id, output_index=index,
                    name=call.name, arguments=call.arguments)
        yield event("response.output_item.done", output_index=index, item=call)
        items.append(call)
    final.output = items
    entry = server.responses.entries.get(run.rid) if run.req.store else None
    if entry is not None:  # the stored copy holds the streamed ids (unless a full store has dropped it already)
        entry.response = final.model_dump()
    # OpenAI's last event names the status: a response cut by max_output_tokens ends with response.incomplete.
    yield event("response.incomplete" if final.status == "incomplete" else "response.completed", response=final)


class StreamedItems:
    """A streamed response's reasoning and message items: opened at their first text, the thought closed before
    the message opens, numbered in the order they opened."""

    def __init__(self):
        self.thought = OutputReasoning(id=new_id("rs"), status="in_progress", content=[])
        self.message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        self.index: dict[str, int] = {}  # item id → output_index, once opened
        self.texts: dict[str, str] = {}  # item id → its text so far
        self.closed: set[str] = set()

    def open(self, event: Events, item: OutputReasoning | OutputMessage, part: BaseModel) -> list[str]:
        if item.id in self.index:
            return []
        self.index[item.id], self.texts[item.id] = len(self.index), ""
        at = dict(output_index=self.index[item.id])
        return [event("response.output_item.added", item=item, **at),
                event("response.content_part.added", item_id=item.id, content_index=0, part=part, **at)]

    def think(self, event: Events, piece: str) -> list[str]:
        """A piece of the thought (the item opens with the thought, even an empty one)."""
        out = self.open(event, self.thought, ReasoningText(text=""))
        if piece:
            self.texts[self.thought.id] += piece
            out.append(event("response.reasoning_text.delta", item_id=self.thought.id,
                             output_index=self.index[self.thought.id], content_index=0, delta=piece))
        return out

    def say(self, event: Events, piece: str) -> list[str]:
        out = self.close_thought(event) + self.open(event, self.message, OutputText(text=""))
        self.texts[self.message.id] += piece
        out.append(event("response.output_text.delta", item_id=self.message.id,
                         output_index=self.index[self.message.id], content_index=0, delta=piece, logprobs=[]))
        return out

    def close_thought(self, event: Events) -> list[str]:
        item = self.thought
        if item.id not in self.index or item.id in self.closed:
            return []
        self.closed.add(item.id)
        done, at = ReasoningText(text=self.texts[item.id]), dict(item_id=item.id, output_index=self.index[item.id])
        item.content, item.status = [done], "completed"
        return [event("response.reasoning_text.done", content_index=0, text=done.text, **at),
                event("response.content_part.done", content_index=0, part=done, **at),
                event("response.output_item.done", output_index=at["output_index"], item=item)]

    def close_message(self, event: Events, with_tools: bool, finish: str | None) -> list[str]:
        item = self.message
        if item.id not in self.index:
            return []
        text = self.texts[item.id]
        done, at = OutputText(text=text.strip() if with_tools else text), dict(item_id=item.id,
                                                                                output_index=self.index[item.id])
        item.content, item.status = [done], "incomplete" if finish == "length" else "completed"
        return [event("response.output_text.done", content_index=0, text=done.text, logprobs=[], **at),
                event("response.content_part.done", content_index=0, part=done, **at),
                event("response.output_item.done", output_index=at["output_index"], item=item)]

    def items(self) -> list:
        return sorted((i for i in (self.thought, self.message) if i.id in self.index), key=lambda i: self.index[i.id])
