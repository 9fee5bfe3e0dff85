"""Thoughts kept apart, served: a tiny Qwen3 that thinks, driven by the official `openai` client through chat
completions and the Responses API, whole and streamed, with a draft model's speculation (several tokens a
step).

The model is real (our loader, the engine, the detokenizer) and its weights are made so that greedy decoding
writes a known answer: attention and MLP outputs are zero, so a position's last hidden state is its token's
embedding, and the head maps each token's embedding to its successor's logit. After the chat template's
"assistant" it writes `<think> let me see </think> Paris <tool_call> {call} </tool_call>` and stops.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import transformers
from test_server import live_server, openai_client

openai = pytest.importorskip("openai")
tokenizers = pytest.importorskip("tokenizers")

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
WORDS = ["<unk>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "user", "assistant", "system", "tool",
         "let", "me", "see", "Paris", "<tool_call>", CALL, "</tool_call>"]
NEXT = {"assistant": "<think>", "<think>": "let", "let": "me", "me": "see", "see": "</think>", "</think>": "Paris",
        "Paris": "<tool_call>", "<tool_call>": CALL, CALL: "</tool_call>", "</tool_call>": "<|im_end|>"}
# Renders tools (so the Hermes format reads calls); `open_thought` opens the thought in the prompt (DeepSeek-R1's
# way); enable_thinking false writes an empty thought (Qwen3's way).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nCall tools as <tool_call> blocks<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_thought is defined and open_thought %}<think>\n{% endif %}{% endif %}")
RAW = f"<think> let me see </think> Paris <tool_call> {CALL} </tool_call>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY = dict(temperature=0, model="thinker")


def save_thinker(folder: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True)
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    cfg = transformers.Qwen3Config(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1,
                                   bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        embed = torch.randn(len(WORDS), cfg.hidden_size)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros_like(embed)
        for word, after in NEXT.items():
            head[WORDS.index(after)] += 10 * embed[WORDS.index(word)]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    return folder


pytestmark = pytest.mark.filterwarnings("ignore:the draft model:UserWarning")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from speculant.llm import build_engine

    folder = save_thinker(tmp_path_factory.mktemp("thinker") / "model")
    # The model drafts for itself: every draft is accepted, so a step writes several tokens (and tags arrive
    # inside longer pieces).
    return build_engine(str(folder), max_model_len=256, speculative_config={
        "method": "draft_model", "model": str(folder), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def client(engine):
    with openai_client(engine, "thinker") as c:
        yield c


def ask(**extra) -> dict:
    return dict(messages=[{"role": "user", "content": "Weather in Paris?"}], **GREEDY, **extra)


def streamed_chat(client, **kwargs) -> tuple[str, str, list, str, object]:
    """(reasoning, content, tool calls, finish reason, usage) from the deltas of a streamed chat completion."""
    reasoning, content, calls, finish, usage = "", "", [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish, usage


def test_the_model_writes_its_thought_and_answer(engine, client):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert client.completions.create(prompt=ids, max_tokens=20, **GREEDY).choices[0].text == RAW


@pytest.mark.parametrize("opened", [False, True])
def test_chat_keeps_the_thought_apart_whole_and_streamed(client, opened):
    kwargs = ask(extra_body={"chat_template_kwargs": {"open_thought": True}} if opened else None)
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought == ("let me see " if opened else " let me see ")  # a first token's text has no space before it
    assert message.content == f" Paris <tool_call> {CALL} </tool_call>"
    # The raw answer reassembles exactly: the opening tag where the model wrote it, the closing tag between.
    assert ("" if opened else "<think>") + thought + "</think>" + message.content == (
        RAW.removeprefix("<think> ") if opened else RAW)
    # <think> (unless the prompt wrote it), let, me, see, </think>
    assert out.usage.completion_tokens_details.reasoning_tokens == (4 if opened else 5)
    reasoning, content, _, finish, usage = streamed_chat(client, **kwargs)
    assert (reasoning, content, finish) == (thought, message.content, out.choices[0].finish_reason)
    assert usage.completion_tokens_details.reasoning_tokens == out.usage.completion_tokens_details.reasoning_tokens


def test_a_thought_cut_short_is_all_reasoning(client):
    out = client.chat.completions.create(**ask(max_tokens=3))
    message = out.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (" let me", None)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens_details.reasoning_tokens == 3
    reasoning, content, _, finish, _ = streamed_chat(client, **ask(max_tokens=3))
    assert (reasoning, content, finish) == (" let me", "", "length")


def test_enable_thinking_reaches_the_template(client):
    out = client.chat.completions.create(**ask(extra_body={"enable_thinking": False}))
    message = out.choices[0].message
    assert "reasoning_content" not in message.model_extra  # no thought: the template wrote an empty one
    assert message.content == f"Paris <tool_call> {CALL} </tool_call>"
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    same = client.chat.completions.create(**ask(extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert same.choices[0].message.content == message.content
    odd = client.chat.completions.create(**ask(extra_body={"chat_template_kwargs": {"self": 1, "a-b": 2}}))
    assert odd.choices[0].message.model_extra["reasoning_content"] == " let me see "  # any name is a variable
    with pytest.raises(openai.BadRequestError, match="disagree"):
        client.chat.completions.create(**ask(extra_body={"enable_thinking": True,
                                                         "chat_template_kwargs": {"enable_thinking": False}}))
    with pytest.raises(openai.BadRequestError, match="may not set messages"):
        client.chat.completions.create(**ask(extra_body={"chat_template_kwargs": {"messages": []}}))


def test_tool_calls_are_read_after_the_thought(client):
    out = client.chat.completions.create(**ask(tools=[WEATHER], tool_choice="auto"))
    choice = out.choices[0]
    assert choice.message.model_extra["reasoning_content"] == " let me see "
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Paris"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    reasoning, content, calls, finish, _ = streamed_chat(client, **ask(tools=[WEATHER], tool_choice="auto"))
    assert (reasoning, content.strip(), finish) == (" let me see ", "Paris", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", call.function.arguments)]


def test_a_constrained_answer_is_all_answer(engine):
    """response_format or a required call constrains the whole answer (its grammar starts at the first token), so
    no part of it is a thought, even where the prompt opened one: no parser for such a request."""
    from speculant.config import StructuredOutputsParams
    from speculant.server.bridge.core import OpenAIServer

    server = OpenAIServer(engine, ["thinker"])
    opened = engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}], template_kwargs={"open_thought": True})
    assert server.reasoning_for(opened, None).opened
    assert not server.reasoning_for(engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}]), None).opened
    assert server.reasoning_for(opened, StructuredOutputsParams(json_object=True)) is None
    assert OpenAIServer(engine, ["thinker"], reasoning_parser="none").reasoning_for(opened, None) is None
    server.executor.shutdown()


def test_responses_hold_a_reasoning_item_whole_and_streamed(client):
    kwargs = dict(model="thinker", input="Weather in Paris?", temperature=0, tools=[
        {"type": "function", **WEATHER["function"]}])
    out = client.responses.create(**kwargs)
    assert [i.type for i in out.output] == ["reasoning", "message", "function_call"]
    thought = out.output[0]
    assert thought.summary == [] and [(c.type, c.text) for c in thought.content] == [("reasoning_text", " let me see ")]
    assert out.output_text == "Paris" and out.output[2].name == "get_weather"
    assert out.usage.output_tokens_details.reasoning_tokens == 5
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == " let me see "
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == deltas and final.output_text == "Paris"
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call")]
    # The thought is done before the answer starts.
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == args_done.arguments == final.output[2].arguments
    # An earlier answer's output, reasoning item included, goes back as input.
    again = client.responses.create(**{**kwargs, "input": [
        {"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in out.output],
        {"type": "function_call_output", "call_id": out.output[2].call_id, "output": "sunny"}]})
    assert again.output[0].type == "reasoning"


def test_a_tokenizer_llguidance_cannot_read_is_a_400_not_a_500(client):
    """This tokenizer has no decoder, which llguidance needs to read its pieces: response_format is refused
    with the reason, and the server goes on serving."""
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(response_format={"type": "json_object"}, **ask())
    error = refused.value.body
    assert "structured output cannot use this model's tokenizer" in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert client.chat.completions.create(**ask()).choices[0].finish_reason in ("stop", "length")


def test_messages_hold_thinking_blocks_whole_and_streamed(engine):
    """Anthropic's Messages API through the `anthropic` SDK: the thought as a thinking block, before the text and
    the tool_use; `thinking` disabled reaches the template's switch."""
    anthropic = pytest.importorskip("anthropic")
    from speculant.server.http.app import create_app

    kwargs = dict(model="thinker", extra_body={"temperature": 0}, max_tokens=40,
                  messages=[{"role": "user", "content": "Weather?"}],
                  tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
    with live_server(create_app(engine, ["thinker"])) as base:
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        out = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        off = client.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
    assert [b.type for b in out.content] == ["thinking", "text", "tool_use"]
    assert out.content[0].thinking == " let me see " and out.content[1].text == "Paris"
    assert out.content[2].input == json.loads(CALL)["arguments"] and out.stop_reason == "tool_use"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == " let me see "
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == out.content[2].input and final.content[1].text.strip() == "Paris"
    assert [b.type for b in off.content] == ["text", "tool_use"]  # the template wrote an empty thought
