"""POST /v1/responses driven by the official `openai` client (responses.create, responses.stream, a function
tool's round trip through previous_response_id, text.format json_schema), against the bundled SmolLM2 with
prompt lookup k = 4 and the prefix cache on; the store's bounds and the API's 4xx answers."""

from __future__ import annotations

import json

import pytest
from conftest import server_engine
from test_server import openai_client

from speculant.server.responses.store import ResponseStore

openai = pytest.importorskip("openai")

GREEDY = dict(temperature=0)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, 1024)


@pytest.fixture(scope="module")
def client(engine):
    with openai_client(engine) as c:
        yield c


def test_a_response_is_the_chat_completions_answer(client):
    out = client.responses.create(model="smollm", input="Name a colour.", instructions="Answer in one word.",
                                  max_output_tokens=12, **GREEDY)
    chat = client.chat.completions.create(model="smollm", max_tokens=12, **GREEDY, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert out.output_text == chat.choices[0].message.content
    assert out.output[0].type == "message" and out.output[0].content[0].type == "output_text"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_a_continued_response_reads_its_conversation_from_the_prefix_cache(client):
    first = client.responses.create(model="smollm", input="Tell me about Paris.", max_output_tokens=16,
                                    metadata={"run": "1"}, reasoning={"effort": "low"}, include=[], **GREEDY)
    second = client.responses.create(model="smollm", previous_response_id=first.id, input="And London?",
                                     max_output_tokens=8, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).metadata == {"run": "1"}
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.create(model="smollm", previous_response_id=first.id, input="Hi", max_output_tokens=2)
    unkept = client.responses.create(model="smollm", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_json_schema_text_format(client):
    out = client.responses.create(model="smollm", input="Give me a person as JSON.", max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
                                  **GREEDY)
    answer = json.loads(out.output_text)
    assert list(answer) == ["name", "age"] and isinstance(answer["age"], int)
    assert out.model_extra["speculative_stats"]["num_accepted_tokens"] > 0


def test_a_function_tool_round_trip_through_previous_response_id(client):
    call = client.responses.create(model="smollm", input="What is the weather like in Paris?", tools=[WEATHER],
                                   tool_choice="required", max_output_tokens=60, **GREEDY)
    calls = [i for i in call.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    answer = client.responses.create(model="smollm", previous_response_id=call.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 degrees"}],
        max_output_tokens=40, **GREEDY)
    assert answer.status in ("completed", "incomplete")
    # The loop ends: after the tool's result, with tool_choice "auto", the model answers in text.
    assert [i.type for i in answer.output] == ["message"] and "21" in answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0
    # The whole history sent back as input (as the Agents SDK does without previous_response_id) also runs.
    again = client.responses.create(model="smollm", tools=[WEATHER], max_output_tokens=4, **GREEDY, input=[
        {"role": "user", "content": "What is the weather like in Paris?"},
        *[i.model_dump() for i in call.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 degrees"}])
    assert again.status in ("completed", "incomplete")


def test_stream_events_in_the_order_the_client_reads_them(client):
    kwargs = dict(model="smollm", input="Name a colour.", instructions="Answer in one word.", max_output_tokens=16,
                  **GREEDY)  # an answer that ends by itself (one cut short: response.incomplete, below)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed"
    assert deltas == final.output_text == client.responses.create(**kwargs).output_text


def test_a_streamed_call(client):
    with client.responses.stream(model="smollm", input="What is the weather like in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [i.arguments for i in final.output if i.type == "function_call"] == [e.arguments for e in done]
    assert json.loads(done[0].arguments)["city"]
    for call in done:  # each call's deltas reassemble its arguments
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                       and e.item_id == call.item_id) == call.arguments


def test_bad_requests_get_openai_errors(client):
    def refused(match: str, **body):
        with pytest.raises(openai.BadRequestError, match=match):
            client.responses.create(model="smollm", max_output_tokens=2, **body)

    refused("'web_search'", input="Hi", tools=[{"type": "web_search"}])
    refused("input\\[0\\]", input=[{"type": "message", "role": "user"}])
    refused("input\\[0\\].*'input_image'", input=[{"type": "input_image", "image_url": "x"}])
    refused("no function_call before it", input=[{"type": "function_call_output", "call_id": "c1", "output": "1"}])
    refused("not in tools", input="Hi", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"})
    refused("'top_logprobs'", input="Hi", extra_body={"top_logprobs": 3})
    refused("'include'", input="Hi", include=["message.output_text.logprobs"])



# -- the edges: each of these passed through (or was refused) before -------------------------------------


def test_max_tokens_is_refused_not_ignored(client):
    """Chat's max_tokens, accepted and ignored, let an answer run to the context's end."""
    with pytest.raises(openai.BadRequestError, match="send max_output_tokens"):
        client.responses.create(model="smollm", input="Hi", extra_body={"max_tokens": 4}, **GREEDY)


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "name": "person"}, {"type": "json_schema", "schema": PERSON}])
def test_a_json_schema_format_needs_its_name_and_schema(client, fmt):
    with pytest.raises(openai.BadRequestError, match="needs a name and its schema"):
        client.responses.create(model="smollm", input="Hi", text={"format": fmt}, max_output_tokens=2)


def test_an_answer_cut_short_is_incomplete_whole_and_streamed(client):
    kwargs = dict(model="smollm", input="Tell me about Paris.", max_output_tokens=3, **GREEDY)
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [i.status for i in whole.output] == ["incomplete"]
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert [i.status for i in last.response.output] == ["incomplete"]
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    assert "response.completed" not in [e.type for e in events]


def test_neutral_values_are_accepted_and_others_refused(client):
    out = client.responses.create(model="smollm", input="Hi", max_output_tokens=2, truncation="disabled",
                                  background=False, top_logprobs=0, **GREEDY)
    assert out.status in ("completed", "incomplete")
    for field, value in (("truncation", "auto"), ("background", True), ("top_logprobs", 3)):
        with pytest.raises(openai.BadRequestError, match=f"'{field}'"):
            client.responses.create(model="smollm", input="Hi", max_output_tokens=2, extra_body={field: value})


def test_an_empty_previous_response_id_is_refused(client):
    """Any other id that names no stored response is a 404; an empty one started a new conversation."""
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="smollm", input="Hi", previous_response_id="", max_output_tokens=2)


def test_a_forced_call_cut_short_leaves_no_raw_markup(client):
    kwargs = dict(model="smollm", input="What is the weather like in Paris?", tools=[WEATHER],
                  tool_choice="required", max_output_tokens=5, **GREEDY)
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.output == [] and whole.output_text == ""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.output == []
    assert not [e for e in events if e.type == "response.output_text.delta"]

def test_the_store_takes_its_bounds_from_the_serve_flags(engine):
    from speculant.server.bridge.core import OpenAIServer
    from speculant.server.http.guard import ServerLimits

    server = OpenAIServer(engine, ["smollm"], ServerLimits(responses_store_size=2, responses_store_age_s=60))
    assert (server.responses.size, server.responses.max_age_s) == (2, 60)
    server.executor.shutdown()


def test_the_store_drops_the_oldest_and_the_expired():
    store = ResponseStore(size=2, max_age_s=60)
    for rid in ("a", "b", "c"):
        store.put(rid, {}, [])
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    store.entries["b"].at -= 120
    assert store.get("b") is None and store.get("c") is not None


def test_auto_tool_prompt_lets_the_model_answer_in_text():
    """tool_choice "auto": the SmolLM2 tool prompt allows a text answer (its own forbids any text, so an agent's
    loop after a tool result could never end); "required" keeps SmolLM2's prompt, the grammar forcing the call."""
    from speculant.structured.tools import SMOLLM2, SMOLLM2_SYSTEM

    functions = [{k: v for k, v in WEATHER.items() if k != "type"}]
    auto = SMOLLM2.messages_for_template([{"role": "user", "content": "Hi"}], functions, auto=True)[0]["content"]
    forced = SMOLLM2.messages_for_template([{"role": "user", "content": "Hi"}], functions)[0]["content"]
    assert "NO other text" not in auto and "answer in plain text" in auto and '"get_weather"' in auto
    assert forced == SMOLLM2_SYSTEM.format(tools=json.dumps(functions))


def test_parallel_calls_in_one_answer_are_separate_items():
    from speculant.server.responses.routes import output_items
    from speculant.structured.tools import SMOLLM2

    text = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>')
    items, calls = output_items(text, SMOLLM2)
    assert [i.type for i in items] == ["function_call", "function_call"]
    assert [json.loads(i.arguments)["city"] for i in items] == ["Paris", "Rome"]
    assert len({i.call_id for i in items}) == 2 and [c["id"] for c in calls] == [i.call_id for i in items]
