"""Greedy speculative output equals plain greedy output, token for token (float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models import native
from speculant.models.loader import load_model
from speculant.proposers import build_proposer

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Repetitive prompts give the n-gram proposer something to find.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], list(range(20, 45)) + list(range(20, 30)), [9]]


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


def run(target, spec: dict | None, prompts, params=GREEDY, max_batch_size=4):
    cfg = SpeculativeConfig.parse(spec)
    k = cfg.num_speculative_tokens if cfg else 0
    proposer = build_proposer(cfg, target, max_batch_size, 256 + k + 1) if cfg else None
    engine = Engine(target, proposer, k, max_batch_size=max_batch_size, max_model_len=256)
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.generate(seqs)
    return [s.output_ids for s in seqs], engine


@pytest.fixture(scope="module")
def plain(target):
    return run(target, None, PROMPTS)[0]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_equals_plain(target, tiny_pair, plain, method, k):
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(tiny_pair[1])
    one_by_one = [run(target, spec, [p], max_batch_size=1)[0][0] for p in PROMPTS]
    batched, engine = run(target, spec, PROMPTS)  # ragged batch of 4
    assert one_by_one == plain
    assert batched == plain
    assert engine.stats.num_draft_tokens > 0


@pytest.fixture(scope="module")
def corpus(target, tmp_path_factory):
    """A corpus table of the target's own greedy answers to other prompts: its drafts are often right."""
    from speculant.proposers.corpus import CorpusTable

    others = [[3 + i, 40 + 2 * i, 17] for i in range(12)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.safetensors"
    answers = [p + o for p, o in zip(others, run(target, None, others)[0])]
    CorpusTable.build(answers + PROMPTS, target, min_count=1, min_share=0.0).save(path)
    return str(path)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "draft_model", "num_speculative_tokens": 3, "lookup_first": True},
                                  {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True}])
def test_corpus_drafts_keep_greedy_output(target, tiny_pair, plain, corpus, spec):
    spec |= {"model": str(tiny_pair[1])} if spec["method"] == "draft_model" else {}
    one_by_one = [run(target, {**spec, "corpus": corpus}, [p], max_batch_size=1)[0][0] for p in PROMPTS]
    batched, engine = run(target, {**spec, "corpus": corpus}, PROMPTS)
    assert one_by_one == plain and batched == plain
    assert "corpus" in engine.proposer.name.split("+")
    # The corpus drafted: more drafts kept than prompt lookup alone keeps.
    assert engine.stats.num_accepted_tokens > run(target, spec, PROMPTS)[1].stats.num_accepted_tokens


def test_identical_draft_accepts_everything(target, tiny_pair):
    spec = {"method": "draft_model", "model": str(tiny_pair[0]), "num_speculative_tokens": 4}
    outputs, engine = run(target, spec, PROMPTS)
    assert engine.stats.acceptance_rate >= 0.99
    assert engine.stats.mean_acceptance_length > 4.5


def test_ngram_on_repetitive_prompt_accepts_and_saves_passes(target, plain):
    outputs, engine = run(target, {"method": "ngram", "num_speculative_tokens": 5}, PROMPTS)
    assert outputs == plain
    plain_passes = sum(len(o) for o in plain)
    assert engine.stats.target_passes < plain_passes


def test_batch_larger_than_slots_queues(target, plain):
    outputs, engine = run(target, {"method": "ngram", "num_speculative_tokens": 3}, PROMPTS, max_batch_size=2)
    assert outputs == plain


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_requests_with_one_prompt_share_its_prefill(target, tiny_pair, plain, monkeypatch, method):
    """Requests with the same prompt (the API's n) admitted together run its prompt pass once; the
    others' cache rows are copies, and each writes what it writes alone. (The G-tests of
    test_distribution.py sample thousands of requests of one prompt this way.)"""
    prompt = PROMPTS[2]
    prompt_passes = []
    forward = type(target.model).forward

    def counting(self, tokens, *args, **kwargs):
        if self is target.model and tokens.shape[1] == len(prompt) - 1:
            prompt_passes.append(tokens.shape[0])
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(target.model), "forward", counting)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(tiny_pair[1])
    assert run(target, spec, [prompt] * 3 + [PROMPTS[0]])[0] == [plain[2]] * 3 + [plain[0]]
    assert prompt_passes == [1]
    # A one-token prompt has no prompt pass (its token is the first step's input): nothing to share.
    assert run(target, spec, [PROMPTS[3]] * 2 + [PROMPTS[1]])[0] == [plain[3]] * 2 + [plain[1]]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_target_speculation_equals_its_own_plain_output(tiny_pair, quantization):
    target = load_model(tiny_pair[0], quantization=quantization)
    plain_quantized = run(target, None, PROMPTS)[0]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 3}):
        assert run(target, spec, PROMPTS)[0] == plain_quantized


def test_bfloat16_speculation_equals_its_own_plain_output(tiny_pair):
    """bf16 is the fast CPU path (flat verify cost): at batch 1 its speculative output is its own
    plain output, token for token."""
    target = load_model(tiny_pair[0], dtype="bfloat16")
    plain_bf16 = [run(target, None, [p], max_batch_size=1)[0][0] for p in PROMPTS]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 3}):
        assert [run(target, spec, [p], max_batch_size=1)[0][0] for p in PROMPTS] == plain_bf16


def test_bfloat16_batched_speculation_equals_plain_output(tmp_path):
    """With the native attention kernel (head size 64 here) a bf16 row scores the same bits in any
    batch: a ragged batch's speculative output equals plain output, and plain output alone."""
    if not native.attention_usable(64):
        pytest.skip("the native attention kernel does not run here (no AVX2, or no compiler)")
    # Small weights keep the logits close together: near-ties, where a differently summed row flips.
    folder = save_tiny(tmp_path, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=256, init_std=0.02)
    target = load_model(folder, dtype="bfloat16")
    plain = run(target, None, PROMPTS)[0]
    assert [run(target, None, [p], max_batch_size=1)[0][0] for p in PROMPTS] == plain
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "ngram", "num_speculative_tokens": 7}):
        assert run(target, spec, PROMPTS)[0] == plain


def test_logprobs_are_the_targets_and_unchanged_by_speculation(target, tiny_pair):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = PROMPTS[0]
    engines = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 3}):
        cfg = SpeculativeConfig.parse(spec)
        k = cfg.num_speculative_tokens if cfg else 0
        engine = Engine(target, build_proposer(cfg, target, 1, 64 + k + 1) if cfg else None, k, 1, 64)
        engines.append(engine.generate([engine.add_request(prompt, params)])[0])
    plain = engines[0]
    model = target.model
    with torch.no_grad():
        full = torch.log_softmax(model.logits(model(torch.tensor([plain.tokens[:-1]]), model.new_cache(1, 64),
                                                     torch.tensor([0])))[0], -1)
    for i, (tok, lp) in enumerate(zip(plain.output_ids, plain.logprobs)):
        row = full[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    for seq in engines[1:]:
        assert seq.output_ids == plain.output_ids and len(seq.logprobs) == len(plain.logprobs)
        for a, b in zip(seq.logprobs, plain.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
