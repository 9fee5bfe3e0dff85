"""A request writes the same tokens whatever shares its steps: random batch compositions (other prompts, other
lengths, rows joining and leaving mid-run, k, adaptive k on and off, lookup and draft-model proposers, unseeded
rows beside) against each request decoded alone, greedy and seeded, on every weight path of the tiny models.

"Alone" is plain decoding (docs/lossless.md): a greedy request, and a seeded one with any proposer (lookup drafts,
a draft model's drafts coupled to the seeded draws), writes plain decoding's tokens at any k, adaptive or not."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
from mutants import patch_seeded_rows
from test_adaptive import curve

from speculant.adaptive import AdaptiveK
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models import native
from speculant.models.loader import load_model
from speculant.proposers import build_proposer

MAX_LEN = 96
N_REQUESTS = 8
COMPOSITIONS = 3
PROPOSERS = {"lookup": {"method": "ngram"}, "draft_model": {"method": "draft_model"},
             "draft_model+lookup": {"method": "draft_model", "lookup_first": True}}
SAMPLED = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
           SamplingParams(temperature=0.7, top_k=20, min_p=0.05)]
# (dtype, quantization) as load_model takes them: auto is bf16 on this CPU.
PATHS = [pytest.param("float32", None, id="float32"),
         pytest.param("float32", "int8", id="int8"),
         pytest.param("auto", None, id="auto"),
         pytest.param("float32", "int4", id="int4")]
# Without the native kernels, bf16 and int4 products go through oneDNN and PyTorch's int4 kernel, which give a
# row other bits at other row counts: no promise there (docs/lossless.md).
LIBRARY_KERNELS_DIFFER = {("auto", None), ("float32", "int4")}


@dataclass
class Composition:
    k: int
    rows: int
    adaptive: bool
    joins: list[int]  # the step at which each request is added
    fillers: list[int]  # steps at which an unseeded sampled request joins; the first leaves (aborted) at step 6


def requests(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 2-24 tokens, some repeating themselves (lookup finds drafts there), each greedy or seeded."""
    out = []
    for i in range(N_REQUESTS):
        pattern = [rng.randrange(3, 96) for _ in range(rng.randint(2, 6) if i % 2 else 24)]
        prompt = (pattern * 4)[:rng.randint(2, 24)]
        params = SamplingParams(temperature=0) if i % 3 == 0 else replace(rng.choice(SAMPLED), seed=rng.randrange(1000))
        out.append((prompt, replace(params, max_tokens=rng.randint(4, 40), ignore_eos=True)))
    return out


def composition(rng: random.Random) -> Composition:
    return Composition(k=rng.randint(1, 5), rows=rng.randint(2, 6), adaptive=rng.random() < 0.5,
                       joins=[rng.randrange(0, 12) for _ in range(N_REQUESTS)],
                       fillers=sorted(rng.randrange(0, 10) for _ in range(3)))


def engine_for(target, draft: str, proposer: str | None, k: int, rows: int, adaptive: bool) -> Engine:
    if proposer is None:
        return Engine(target, max_batch_size=rows, max_model_len=MAX_LEN)
    spec = SpeculativeConfig.parse({**PROPOSERS[proposer], "num_speculative_tokens": k,
                                    **({"model": draft} if "draft" in proposer else {})})
    return Engine(target, build_proposer(spec, target, rows, MAX_LEN + k + 1), k, max_batch_size=rows,
                  max_model_len=MAX_LEN, adaptive=AdaptiveK(curve(32), k_max=k) if adaptive else None)


def alone(target, draft: str, proposer: str | None, k: int, request) -> list[int]:
    engine = engine_for(target, draft, proposer, k, 1, False)
    return engine.generate([engine.add_request(*request)])[0].output_ids


def run_mixed(engine: Engine, reqs: list, mix: Composition) -> list[list[int]]:
    """The requests through one engine, joining at their steps beside the fillers → each one's output."""
    seqs, fillers, step = {}, [], 0
    while len(seqs) < len(reqs) or engine.has_unfinished():
        for i, at in enumerate(mix.joins):
            if at == step:
                seqs[i] = engine.add_request(*reqs[i])
        fillers += [engine.add_request([5, 6, 7, 5, 6, 7], SamplingParams(temperature=0.9, max_tokens=30,
                                                                             ignore_eos=True))
                    for at in mix.fillers if at == step]
        if step == 6 and fillers:
            engine.abort(fillers[0].request_id)
        engine.step()
        step += 1
    return [seqs[i].output_ids for i in range(len(reqs))]


def expected_alone(target, draft: str, proposer: str, mix: Composition, reqs: list) -> list[list[int]]:
    """Each request's output decoded alone without speculation: every request here is greedy or seeded, and
    with every proposer, at any k, adaptive or not, such a request writes plain decoding's tokens."""
    return [alone(target, draft, None, 0, request) for request in reqs]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models' passes: a thread pool's wake-ups cost more than the work (10x on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded() -> dict:
    """Targets loaded so far, by (dtype, quantization)."""
    return {}


def check(target, draft: str, proposer: str, seed: str) -> int:
    """COMPOSITIONS random runs, each request against its promise → requests checked."""
    checked = 0
    for n in range(COMPOSITIONS):
        rng = random.Random(f"{seed}-{n}")
        reqs, mix = requests(rng), composition(rng)
        expected = expected_alone(target, draft, proposer, mix, reqs)
        got = run_mixed(engine_for(target, draft, proposer, mix.k, mix.rows, mix.adaptive), reqs, mix)
        for request, e, g in zip(reqs, expected, got):
            assert g == e, (n, mix, request)
            checked += 1
    return checked


@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("dtype, quantization", PATHS)
def test_each_request_writes_what_it_writes_alone(tiny_pair, loaded, dtype, quantization, proposer):
    if native.level() == "off" and (dtype, quantization) in LIBRARY_KERNELS_DIFFER:
        pytest.skip(native.off_reason() + ": PyTorch's kernels make no promise across row counts")
    if (dtype, quantization) not in loaded:
        loaded[dtype, quantization] = load_model(tiny_pair[0], dtype=dtype, quantization=quantization)
    assert check(loaded[dtype, quantization], str(tiny_pair[1]), proposer, proposer) >= COMPOSITIONS * 3


@pytest.mark.parametrize("mutant, proposer", [("seeded_by_the_rule", "draft_model"),
                                             ("coupled_draw_by_the_rule", "draft_model+lookup")])
def test_a_mutant_that_judges_seeded_drafts_by_the_rule_is_caught(tiny_pair, loaded, monkeypatch, mutant, proposer):
    """Seeded rows whose drafts the acceptance rule judges, drawn from q or drawn as plain decoding draws: neither
    writes plain decoding's tokens."""
    if ("float32", None) not in loaded:
        loaded["float32", None] = load_model(tiny_pair[0])
    patch_seeded_rows(mutant, monkeypatch)
    with pytest.raises(AssertionError):
        for n in range(4):
            check(loaded["float32", None], str(tiny_pair[1]), proposer, f"mutant-{n}")
