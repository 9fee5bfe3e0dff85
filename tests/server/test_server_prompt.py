"""Prompt scoring over HTTP, driven by the official `openai` client: completions' echo with logprobs (what
lm-eval's local-completions reads), vLLM's prompt_logprobs on completions and chat, POST /tokenize and
/detokenize. The values are the target's own: a direct forward pass's, alone, in a batch, from the prefix
cache (the bundled SmolLM2, prompt lookup k = 4, the prefix cache on)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import server_engine, target_prompt_logprobs
from test_server import live_server

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, 512)


@pytest.fixture(scope="module")
def url(engine):
    from speculant.server.http.app import create_app

    with live_server(create_app(engine, ["smollm"])) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def echo_scores(client, prompt: str = PROMPT, max_tokens: int = 0):
    return client.completions.create(model="smollm", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
                                     temperature=0)


def test_echo_logprobs_are_the_targets_alone_batched_and_cached(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    out = echo_scores(client)
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert lp.text_offset[1] == len(lp.tokens[0])
    want = target_prompt_logprobs(engine.model, ids)
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-5, rtol=0)
    assert all(len(top) == 1 and max(top.values()) >= v for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    with ThreadPoolExecutor(4) as pool:  # 4 at once; the prefix cache holds the prompt by now
        batched = list(pool.map(lambda _: echo_scores(client).choices[0].logprobs.token_logprobs, range(4)))
    assert batched == [lp.token_logprobs] * 4
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # scored prompts never read the prefix cache


def test_echo_with_a_completion_puts_the_prompt_first(client, engine):
    out = echo_scores(client, max_tokens=4).choices[0]
    plain = client.completions.create(model="smollm", prompt=PROMPT, logprobs=1, max_tokens=4, temperature=0)
    assert out.text == PROMPT + plain.choices[0].text
    n = len(engine.tokenizer.encode(PROMPT))
    assert out.logprobs.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert out.logprobs.token_logprobs[:n] == echo_scores(client).choices[0].logprobs.token_logprobs


def test_streamed_echo_sends_the_prompt_in_the_first_chunk(client):
    chunks = list(client.completions.create(model="smollm", prompt=PROMPT, echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo_scores(client, max_tokens=3).choices[0].text


def test_vllm_prompt_logprobs_on_completions_and_chat(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    out = client.completions.create(model="smollm", prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    want = target_prompt_logprobs(engine.model, ids)
    for entry, tok, value in zip(scored[1:], ids[1:], want.tolist()):
        assert abs(entry[str(tok)]["logprob"] - value) < 1e-5
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] or entry[str(tok)]["rank"] > 2
    chat = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and all(len(e) == 1 for e in scored[1:])


def test_bad_scoring_requests_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="echo with n > 1"):
        client.completions.create(model="smollm", prompt=PROMPT, echo=True, n=2, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens 0"):
        client.completions.create(model="smollm", prompt=PROMPT, max_tokens=0)


def test_tokenize_and_detokenize(url, engine):
    with httpx.Client(base_url=url, timeout=60) as http:
        out = http.post("/tokenize", json={"model": "smollm", "prompt": PROMPT}).json()
        assert out == {"count": len(out["tokens"]), "max_model_len": 512, "tokens": engine.tokenizer.encode(PROMPT)}
        back = http.post("/detokenize", json={"model": "smollm", "tokens": out["tokens"]}).json()
        assert back == {"prompt": engine.tokenizer.decode(out["tokens"], skip_special_tokens=False)}
        messages = [{"role": "user", "content": "Hi"}]
        chat = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
        assert chat["tokens"] == engine.tokenizer.encode_chat(messages)
        bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert chat["tokens"][:len(bare["tokens"])] == bare["tokens"] and bare["count"] < chat["count"]
        assert http.post("/tokenize", json={"prompt": PROMPT, "messages": messages}).status_code == 400
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
