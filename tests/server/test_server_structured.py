"""response_format and tools over HTTP, on the bundled model with prompt lookup (the official client)."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import server_engine
from test_server import GREEDY, live_server

from speculant.structured.tools import HERMES, SMOLLM2, ToolCallStream, tool_format

openai = pytest.importorskip("openai")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, 1024)


@pytest.fixture(scope="module")
def url(engine):
    from speculant.server.http.app import create_app

    with live_server(create_app(engine, ["smollm"])) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_json_schema_answer_is_valid_and_speculated(client):
    out = client.chat.completions.create(
        model="smollm", messages=[{"role": "user", "content": "Give me a person as JSON."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, **GREEDY)
    answer = json.loads(out.choices[0].message.content)
    assert list(answer) == ["name", "age"] and isinstance(answer["age"], int)
    assert out.choices[0].finish_reason == "stop"
    stats = out.model_extra["speculative_stats"]
    assert stats["num_accepted_tokens"] > 0  # the forced keys and quotes at least


def test_json_object_answer_parses(client):
    out = client.chat.completions.create(
        model="smollm", messages=[{"role": "user", "content": "Describe Paris in JSON."}], max_tokens=40,
        response_format={"type": "json_object"}, **GREEDY)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_answer_cut_by_max_tokens_is_a_valid_prefix(client, engine):
    out = client.chat.completions.create(
        model="smollm", messages=[{"role": "user", "content": "Give me a person as JSON."}], max_tokens=6,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, **GREEDY)
    assert out.choices[0].finish_reason == "length"
    from speculant.config import StructuredOutputsParams

    state = engine.grammars.state(StructuredOutputsParams(json=PERSON))
    ids = engine.tokenizer.encode(out.choices[0].message.content, add_special_tokens=False)
    assert state.valid_prefix(ids) == len(ids) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_called_with_valid_arguments(client, stream):
    kwargs = dict(model="smollm", messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
        assert choice.message.content is None
    else:
        calls, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert set(json.loads(calls[0].function.arguments)) == {"city"}


def streamed_calls(chunks) -> tuple[list, str]:
    calls, finish = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return calls, finish


def test_required_calls_one_of_the_tools(client):
    choice = client.chat.completions.create(model="smollm", messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                            tool_choice="required", **GREEDY).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "get_time"}
    for call in choice.message.tool_calls:
        assert "city" in json.loads(call.function.arguments)


def test_tool_round_trip(client):
    """Call, run the tool, hand its result back, read the answer: the docs' example."""
    first = client.chat.completions.create(model="smollm", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, **GREEDY).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    second = client.chat.completions.create(model="smollm", messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=30, **GREEDY).choices[0]
    assert second.message.content and second.message.tool_calls is None


def test_auto_and_none_answer(client):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model="smollm", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                             max_tokens=40, **GREEDY).choices[0]
        assert out.message.content or out.message.tool_calls
        if choice == "none":
            assert out.message.tool_calls is None


@pytest.mark.parametrize("body, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "if": {}}}}},
     "response_format", "if"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "type json_schema needs a json_schema object"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tool_choice", "share"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": {"a": {"type": "x"}}}}}],
      "tool_choice": "required"}, "tools", "Invalid type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tools"),
])
def test_bad_structured_input_gets_a_400_naming_why(url, client, body, param, reason):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and reason in error["message"], error
    assert error["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model="smollm", messages=ASK, max_tokens=2, **GREEDY)
    assert ok.choices[0].message.content is not None


# -- the formats, without the model ----------------------------------------------------------------------


def test_formats_parse_their_calls():
    content, calls = SMOLLM2.parse('Sure.<tool_call>[{"name": "f", "arguments": {"a": 1}}, '
                                   '{"name": "g", "arguments": {}}]</tool_call>')
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    content, calls = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                                  '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>')
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert HERMES.parse("no calls here") is None
    assert HERMES.parse("<tool_call>{not json</tool_call>") is None


def test_templates_choose_their_format():
    assert tool_format("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>") is HERMES
    assert tool_format("{{ message['content'] }}") is SMOLLM2 and tool_format(None) is SMOLLM2


def test_stream_holds_text_from_where_a_call_may_begin():
    stream = ToolCallStream(SMOLLM2)
    assert stream.push("Let me check. <tool") == "Let me check. "
    assert stream.push('_call>[{"name": "f", "arguments": {}}]') == ""
    assert stream.push("</tool_call>") == ""
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"]["name"] == "f"
    plain = ToolCallStream(SMOLLM2)
    assert plain.push("a <to") == "a " and plain.push("ast") == "<toast"
    assert plain.finish() == ("", [])


@pytest.mark.parametrize("fmt", [HERMES, SMOLLM2])
def test_call_grammar_accepts_the_format_and_refuses_other_names(engine, fmt):
    spec = fmt.constraint([WEATHER["function"], TIME["function"]], parallel=True)
    call = {"name": "get_time", "arguments": {"city": "Oslo"}}
    text = (f'<tool_call>[{json.dumps(call)}, {json.dumps(call)}]</tool_call>' if fmt.as_list
            else f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n<tool_call>\n{json.dumps(call)}\n</tool_call>")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert engine.grammars.state(spec).valid_prefix(ids) == len(ids)
    wrong = engine.tokenizer.encode(text.replace("get_time", "rm_rf"), add_special_tokens=False)
    assert engine.grammars.state(spec).valid_prefix(wrong) < len(wrong)
