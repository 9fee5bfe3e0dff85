"""POST /v1/messages driven by the official `anthropic` SDK (messages.create, messages.stream, tools,
count_tokens, its exceptions) on the bundled model with prompt lookup, beside a plain-decoding server of the same
model: speculation on writes the same text and the same tool input. Thinking blocks: test_server_reasoning.py."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import server_engine
from test_server import live_server

from speculant.server.http.app import create_app

anthropic = pytest.importorskip("anthropic")

# Today's SDK has no sampling arguments (older ones and Claude Code send them): in the body.
GREEDY = dict(model="smollm", extra_body={"temperature": 0})
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
KEY = "messages-key"


def sdk(base: str, key: str = KEY):
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, 1024)


@pytest.fixture(scope="module")
def plain_engine(smollm_path):
    from speculant.llm import build_engine

    return build_engine(str(smollm_path), max_batch_size=4, max_model_len=1024)


@pytest.fixture(scope="module")
def url(engine):
    with live_server(create_app(engine, ["smollm"], api_key=KEY)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return sdk(url)


@pytest.fixture(scope="module")
def plain(plain_engine):
    with live_server(create_app(plain_engine, ["smollm"], api_key=KEY)) as base:
        yield sdk(base)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_with_a_system_prompt_is_chats_answer(client, url):
    chat = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": "smollm", "max_tokens": 12, "temperature": 0, "messages": [
            {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]}
    ).json()
    out = client.messages.create(system="Answer in one word.", max_tokens=12, messages=[
        {"role": "user", "content": "Name a colour."}], **GREEDY)
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert text_of(out) == chat["choices"][0]["message"]["content"]
    assert out.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert out.usage.output_tokens == chat["usage"]["completion_tokens"]
    # Anthropic's counts: the prompt's computed tokens and those the prefix cache gave (chat's prompt, the same).
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert out.usage.cache_read_input_tokens > 0
    # System as text blocks (cache_control accepted) is the same prompt.
    again = client.messages.create(system=[{"type": "text", "text": "Answer in one word.",
                                            "cache_control": {"type": "ephemeral"}}], max_tokens=12,
                                   messages=[{"role": "user", "content": "Name a colour."}],
                                   metadata={"user_id": "u1"}, **GREEDY)
    assert text_of(again) == text_of(out)


def test_count_tokens_is_the_prompt(client):
    count = client.messages.count_tokens(model="smollm", system="Be brief.", messages=ASK)
    out = client.messages.create(system="Be brief.", messages=ASK, max_tokens=2, **GREEDY)
    assert count.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens > 10
    with_tools = client.messages.count_tokens(model="smollm", system="Be brief.", messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > count.input_tokens  # the tools' prompt


def test_stream_events_in_the_order_the_sdk_reads_them(client, url):
    kwargs = dict(messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=16, **GREEDY)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if not e.type.endswith(("text", "thinking", "input_json"))]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    whole = client.messages.create(**kwargs)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(final) == \
        text_of(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    # On the wire, a ping follows message_start (the SDK skips it).
    with httpx.stream("POST", f"{url}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={"model": "smollm", "messages": kwargs["messages"], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def test_a_tool_round_trip(client):
    call = client.messages.create(messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=60,
                                  **GREEDY)
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_") and isinstance(uses[0].input["city"], str)
    answer = client.messages.create(tools=[WEATHER], max_tokens=40, **GREEDY, messages=[
        *ASK, {"role": "assistant", "content": call.content},  # the answer's blocks sent back as they came
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny, 21 degrees"}]}])
    # The loop ends: after the tool's result, with tool_choice "auto", the model answers in text.
    assert [b.type for b in answer.content] == ["text"] and "21" in text_of(answer)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.cache_read_input_tokens > 0


def test_a_streamed_tool_call(client):
    kwargs = dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  max_tokens=60, **GREEDY)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads(partial) == use.input and use.input["city"]
    assert final.stop_reason == "tool_use"
    whole = client.messages.create(**kwargs)
    assert [b.input for b in whole.content if b.type == "tool_use"] == [use.input]


def test_stop_sequences_name_the_one_that_stopped(client):
    kwargs = dict(messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=24, **GREEDY)
    full = text_of(client.messages.create(**kwargs))
    word = full.split()[3]
    out = client.messages.create(stop_sequences=["zzzz", word], **kwargs)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", word)
    assert text_of(out) == full[:full.index(word)]
    with client.messages.stream(stop_sequences=[word], **kwargs) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", word, text_of(out))


def test_speculation_writes_plain_decodings_text_and_tool_input(client, plain):
    copy = "Repeat this sentence: the quick brown fox jumps over the lazy dog near the river bank."
    for kwargs in (dict(messages=[{"role": "user", "content": copy}], max_tokens=24),
                   dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=40)):
        fast, slow = client.messages.create(**kwargs, **GREEDY), plain.messages.create(**kwargs, **GREEDY)
        with client.messages.stream(**kwargs, **GREEDY) as stream:
            streamed = stream.get_final_message()
        assert fast.model_extra["speculative_stats"]["num_accepted_tokens"] > 0
        assert slow.model_extra["speculative_stats"]["num_drafts"] == 0
        for out in (fast, streamed):
            assert [b.model_dump(exclude={"id"}) for b in out.content] == \
                [b.model_dump(exclude={"id"}) for b in slow.content]


def test_bad_requests_raise_the_sdks_errors(client, url):
    def refused(match: str, error=anthropic.BadRequestError, **body):
        with pytest.raises(error, match=match):
            client.messages.create(**{"model": "smollm", "max_tokens": 4, "messages": ASK, **body})

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    refused(r"messages\[0\]\.content\[1\].*'image'", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, image]}])
    refused("no tool_use before it", messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}]}])
    refused("prefilled", messages=[*ASK, {"role": "assistant", "content": "It is"}])
    refused("'web_search_20250305'", tools=[{"type": "web_search_20250305", "name": "web_search"}])
    refused("not in tools", tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    refused("needs the tool's name", tools=[WEATHER], tool_choice={"type": "tool"})
    refused("temperature", extra_body={"temperature": 1.5})
    refused("frequency_penalty", extra_body={"frequency_penalty": 1})
    refused("maximum context length", max_tokens=5000)
    refused("does not exist", anthropic.NotFoundError, model="claude-opus")
    with pytest.raises(anthropic.AuthenticationError, match="API key"):
        sdk(url, "wrong").messages.create(model="smollm", max_tokens=2, messages=ASK)
    # Anthropic's body, whatever refused it: the handler, or the guard in front.
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, json={"model": "smollm", "messages": ASK})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(f"{url}/v1/messages", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{url}/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"
