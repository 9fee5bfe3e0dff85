"""The request guard and the limit flags, without a model: the app over a stand-in engine, in process."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import httpx
import pytest
import torch

from speculant.errors import SpeculantError
from speculant.server.http.guard import ServerLimits, allowed_host_names, host_name

KEY = "k-123"


def app_for(limits: ServerLimits, api_key: str | None = KEY, bind_host: str | None = None):
    from speculant.server.http.app import create_app

    engine = SimpleNamespace(tokenizer=None, k=0, max_batch_size=2, max_model_len=16, proposer=None, proposer_name=None,
                             scheduler=SimpleNamespace(policy=None),
                             target=SimpleNamespace(source="/secret/place/model.gguf", quantization=None),
                             model=SimpleNamespace(dtype=torch.float32), device=torch.device("cpu"))
    return create_app(engine, ["m"], api_key=api_key, limits=limits, bind_host=bind_host)


def get(app, path: str, headers: dict | None = None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(go())


def test_the_key_guards_everything_but_health_and_public_metrics():
    app = app_for(ServerLimits())
    for path in ("/metrics", "/v1/models", "/openapi.json", "/docs"):
        r = get(app, path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
    assert get(app, "/v1/models", {"Authorization": f"Bearer {KEY}"}).json()["data"][0]["root"] == "m"
    public = app_for(ServerLimits(public_metrics=True))
    assert get(public, "/metrics").status_code == 200
    assert get(public, "/v1/models").status_code == 401


def test_host_names():
    assert host_name("LOCALHOST:8000") == "localhost" and host_name("[::1]:80") == "::1"
    assert host_name("::1") == "::1" and host_name("example.com") == "example.com"
    assert allowed_host_names("0.0.0.0", []) == {"localhost", "127.0.0.1", "::1"}
    assert "10.0.0.5" in allowed_host_names("10.0.0.5", []) and "api.lan" in allowed_host_names(None, ["api.lan"])
    assert allowed_host_names("127.0.0.1", ["*"]) is None
    app = app_for(ServerLimits(), api_key=None, bind_host="10.0.0.5")
    assert get(app, "/health", {"Host": "10.0.0.5:8000"}).status_code == 200
    assert get(app, "/health", {"Host": "10.0.0.6:8000"}).status_code == 403
    anywhere = app_for(ServerLimits(allowed_hosts=["*"]), api_key=None)
    assert get(anywhere, "/health", {"Host": "whatever.example"}).status_code == 200


def serve_args(*argv: str) -> argparse.Namespace:
    from speculant.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_limit_flags():
    from speculant.server.http.guard import limits_from_args

    limits = limits_from_args(serve_args("--max-body-bytes", "1000", "--max-request-sequences", "8",
                                         "--max-request-tokens", "4096", "--request-timeout", "30",
                                         "--allowed-hosts", "a.lan", "b.lan", "--public-metrics"))
    assert (limits.max_body_bytes, limits.max_sequences, limits.max_request_tokens) == (1000, 8, 4096)
    assert limits.request_timeout_s == 30 and limits.allowed_hosts == ["a.lan", "b.lan"] and limits.public_metrics
    assert limits_from_args(serve_args()) == ServerLimits()
    for flag in ("--max-body-bytes", "--request-timeout", "--header-timeout", "--responses-store-size",
                 "--responses-store-age"):
        with pytest.raises(SpeculantError, match=f"{flag} must be > 0, got 0"):
            limits_from_args(serve_args(flag, "0"))
    with pytest.raises(SpeculantError, match="--responses-store-age must be > 0, got nan"):
        limits_from_args(serve_args("--responses-store-age", "nan"))
    limits = limits_from_args(serve_args("--responses-store-size", "3", "--responses-store-age", "60"))
    assert (limits.responses_store_size, limits.responses_store_age_s) == (3, 60)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_near_zero_temperatures_sample_greedily(temperature):
    """What the API accepts, the sampler must handle: logits / 1e-40 overflow float32."""
    import torch

    from speculant.config import SamplingParams
    from speculant.sampling import SamplingBatch, probabilities

    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = torch.tensor([[[0.5, 3.0, -1.0, 2.9]]])
    sb = SamplingBatch.build([params, SamplingParams(temperature=0.7)], [None, 1], torch.device("cpu"))
    probs = probabilities(logits.expand(2, 1, 4), sb)
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0] and torch.isfinite(probs).all()


def test_top_k_is_bounded_where_the_request_is_made():
    from speculant.config import MAX_TOP_K, SamplingParams

    SamplingParams(top_k=MAX_TOP_K)
    for bad in (MAX_TOP_K + 1, 2**63, -2):
        with pytest.raises(SpeculantError, match="top_k"):
            SamplingParams(top_k=bad)


def test_anthropics_key_header_and_error_shape():
    """x-api-key (Anthropic's clients) opens the same door as the bearer token; on the Messages API's routes a
    refusal has Anthropic's body, elsewhere OpenAI's."""
    app = app_for(ServerLimits())
    assert get(app, "/v1/models", {"x-api-key": KEY}).status_code == 200
    assert get(app, "/v1/models", {"x-api-key": "wrong"}).status_code == 401
    assert get(app, "/v1/models", {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"}).status_code == 200
    refused = get(app, "/v1/messages")
    assert refused.status_code == 401 and refused.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": refused.json()["error"]["message"]}}
    assert "x-api-key" in refused.json()["error"]["message"]
    wrong_method = get(app, "/v1/messages", {"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    assert get(app, "/v1/messages/nope", {"x-api-key": KEY}).json()["error"]["type"] == "not_found_error"
    assert get(app, "/v1/models/nope", {"x-api-key": KEY}).json()["error"]["code"] is None  # OpenAI's shape
