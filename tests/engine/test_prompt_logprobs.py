"""Prompt log-probabilities (SamplingParams.prompt_logprobs) are the target's own: equal to a direct forward pass
of the target over the prompt (fp32 within 1e-5), and on every weight path the same values alone and in a batch
of 4, with a draft model and without, cold and after the prefix cache holds the prompt (engine.score_prompt)."""

from __future__ import annotations

import pytest
import torch
from conftest import target_prompt_logprobs

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.scheduler import scheduler as scheduler_module

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], list(range(20, 45)) + list(range(20, 30)), [9, 4]]
PATHS = [("float32", "none"), ("bfloat16", "none"), ("auto", "int8"), ("auto", "int4")]
TOP = 3



def engine(target, draft_path=None, rows: int = 4, prefix_cache_bytes: int = 0, prefill_chunk: int = 8) -> Engine:
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 4}
                                  if draft_path else None)
    proposer = build_proposer(cfg, target, rows, 256 + 5) if cfg else None
    return Engine(target, proposer, 4 if cfg else 0, max_batch_size=rows, max_model_len=256,
                  prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk)


def run(eng: Engine, prompts: list[list[int]], max_tokens: int = 3) -> list[list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=TOP)
    seqs = eng.generate([eng.add_request(p, params) for p in prompts])
    return [[None if lp is None else (lp.logprob, lp.rank, lp.top) for lp in s.prompt_logprobs] for s in seqs]


def test_prompt_logprobs_equal_a_direct_forward_pass(tiny_pair):
    target = load_model(tiny_pair[0], dtype="float32")
    for prompt, got in zip(PROMPTS, run(engine(target), PROMPTS)):
        assert got[0] is None and len(got) == len(prompt)
        want = target_prompt_logprobs(target.model, prompt)
        assert torch.allclose(torch.tensor([g[0] for g in got[1:]]), want, atol=1e-5, rtol=0)
        for (lp, rank, top), tok in zip(got[1:], prompt[1:]):
            assert top[0][1] >= lp and rank >= 1 and (rank == 1) == (top[0][0] == tok or top[0][1] == lp)


@pytest.mark.parametrize("dtype,quantization", PATHS, ids=lambda v: v)
def test_prompt_logprobs_alone_batched_drafted_and_cached_are_the_same(tiny_pair, dtype, quantization):
    target = load_model(tiny_pair[0], dtype=dtype, quantization=quantization)
    alone = [run(engine(target, rows=1), [p])[0] for p in PROMPTS]
    assert run(engine(target), PROMPTS) == alone, "4 prompts together"
    assert run(engine(target, tiny_pair[1]), PROMPTS) == alone, "a draft model, 4 prompts together"
    warm = engine(target, prefix_cache_bytes=1 << 24)
    for p in PROMPTS:  # the prefix cache now holds every prompt
        warm.generate([warm.add_request(p, SamplingParams(temperature=0, max_tokens=2))])
    assert run(warm, PROMPTS) == alone, "prompts the prefix cache holds"


def test_a_prompt_read_from_the_prefix_cache_would_lose_its_logprobs(tiny_pair, monkeypatch):
    """The mutant: a scored prompt starting from the prefix cache scores only the tokens after the cached ones."""
    target = load_model(tiny_pair[0], dtype="float32")
    cold = run(engine(target), PROMPTS[:1])
    monkeypatch.setattr(scheduler_module, "reads_prefix_cache", lambda seq: True)
    warm = engine(target, prefix_cache_bytes=1 << 24)
    warm.generate([warm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))])
    assert run(warm, PROMPTS[:1]) != cold


def test_max_tokens_0_scores_the_prompt_and_writes_nothing(tiny_pair):
    target = load_model(tiny_pair[0], dtype="float32")
    eng = engine(target)
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0)
    seqs = eng.generate([eng.add_request(p, params) for p in PROMPTS])
    assert [s.output_ids for s in seqs] == [[]] * 4 and {s.finish_reason for s in seqs} == {"length"}
    assert [len(s.prompt_logprobs) for s in seqs] == [len(p) for p in PROMPTS]
    assert not eng.has_unfinished()
    with pytest.raises(Exception, match="max_tokens"):
        SamplingParams(max_tokens=0)
