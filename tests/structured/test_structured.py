"""Structured output under speculation: the grammar's mask is a transform on p and q alike.

Greedy answers under a JSON schema are token for token the plain constrained answers for every proposer
and k; sampled answers under a small grammar follow the target's constrained distribution (G-test, as in
test_distribution.py), and the mutants that mask the target alone or mask every draft position at the
committed state are caught.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import save_tiny
from mutants import GrammarOnTargetOnly, patch_grammar
from test_distribution import ALPHA, BATCH, N_SAMPLES, N_TOKENS, PROMPT, SETTINGS, g_test
from test_eagle import saved_head
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from speculant.config import SamplingParams, SpeculativeConfig, StructuredOutputsParams
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.proposers.draft_model import DraftModelProposer
from speculant.proposers.ngram import NgramProposer
from speculant.sampling import SamplingBatch, constrain, probabilities
from speculant.structured.grammar import GrammarCompiler

# Seeded requests here are judged as unseeded ones are (conftest.rule_path): the acceptance rule's path.
pytestmark = pytest.mark.usefixtures("rule_path")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "quantity_in_stock": {"type": "integer", "minimum": 0, "maximum": 99},
    "available": {"type": "boolean"},
    "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
}, "required": ["name", "quantity_in_stock", "available", "colours"], "additionalProperties": False}
JSON_TEXTS = [json.dumps({"name": n, "quantity_in_stock": i, "available": i % 2 == 0, "colours": ["red", "blue"]})
              for i, n in enumerate(["apple", "pear", "plum", "fig", "kiwi", "lime"])]
PROMPTS = [[1, 40, 41, 42, 40, 41], [1, 7], [1, 90, 91, 92, 93, 94, 95, 96, 97]]


def json_tokenizer(folder, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on a little JSON, saved in `folder`
    (<unk>, <s>, </s> at 0, 1, 2: the tiny models' bos and eos)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(JSON_TEXTS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def json_pair(tmp_path_factory):
    """A tiny target and draft whose tokenizer writes JSON (byte-level BPE, 300 tokens)."""
    root = tmp_path_factory.mktemp("json_pair")
    common = dict(vocab_size=300, init_std=0.1)
    target = save_tiny(root / "target", seed=0, num_hidden_layers=2, **common)
    draft = save_tiny(root / "draft", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64, **common)
    for folder in (target, draft):
        json_tokenizer(folder, 300)
    return target, draft


@pytest.fixture(scope="module")
def json_target(json_pair):
    return load_model(json_pair[0])


def constrained(max_tokens: int = 48, **sampling) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **sampling)


def run(target, spec: dict | None, prompts, params, max_batch_size: int = 4) -> tuple[list[list[int]], Engine]:
    cfg = SpeculativeConfig.parse(spec)
    k = cfg.num_speculative_tokens if cfg else 0
    proposer = build_proposer(cfg, target, max_batch_size, 128 + k + 1) if cfg else None
    engine = Engine(target, proposer, k, max_batch_size=max_batch_size, max_model_len=128)
    seqs = engine.generate([engine.add_request(p, ps) for p, ps in zip(prompts, params)])
    return [s.output_ids for s in seqs], engine


# A free row rides along with the constrained ones: masks are per row.
PARAMS = [constrained(), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), constrained(30)]


@pytest.fixture(scope="module")
def plain(json_target):
    return run(json_target, None, PROMPTS, PARAMS)[0]


def test_plain_answers_match_the_schema(json_target, plain):
    tok = json_target.tokenizer
    answer = json.loads(tok.decode(plain[0]))
    assert list(answer) == list(SCHEMA["properties"])  # in the schema's order
    assert isinstance(answer["quantity_in_stock"], int) and set(answer["colours"]) <= {"red", "green", "blue"}


def test_answer_cut_by_max_tokens_ends_with_length_and_is_a_valid_prefix(json_target, plain):
    engine = Engine(json_target, max_batch_size=1, max_model_len=128)
    seq = engine.generate([engine.add_request(PROMPTS[0], constrained(7))])[0]
    assert seq.finish_reason == "length" and seq.output_ids == plain[0][:7]
    fresh = engine.grammars.state(StructuredOutputsParams(json=SCHEMA))
    assert fresh.valid_prefix(seq.output_ids) == 7
    with pytest.raises(json.JSONDecodeError):
        json.loads(seq.text)


METHODS = {
    "ngram": {"method": "ngram"},
    "draft_model": {"method": "draft_model"},
    "draft_model+lookup": {"method": "draft_model", "lookup_first": True},
    "eagle": {"method": "eagle"},
    "eagle+tree": {"method": "eagle", "tree_width": 2},
    "ngram+adaptive": {"method": "ngram", "adaptive": True},
}


@pytest.fixture(scope="module")
def head(json_target, tmp_path_factory):
    return str(saved_head(json_target, tmp_path_factory.mktemp("head")))


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_under_a_schema_equals_plain(json_target, json_pair, head, plain, method, k, caplog):
    spec = {**METHODS[method], "num_speculative_tokens": k}
    if spec["method"] != "ngram":
        spec["model"] = head if spec["method"] == "eagle" else str(json_pair[1])
    with caplog.at_level(logging.WARNING, logger="speculant"):
        got, engine = run(json_target, spec, PROMPTS, PARAMS)
    assert got == plain
    assert engine.stats.num_accepted_tokens > 0
    # Tokens survive a failed step (its rows are retried alone), its cost does not: no step may fail.
    assert not [r.message for r in caplog.records if "failed" in r.message]


def test_forced_tokens_are_free_drafts(json_target, plain):
    """The keys, quotes and braces the schema forces are drafted and accepted: far fewer target passes
    than tokens, even with a proposer (n-gram) that finds little in these prompts."""
    got, engine = run(json_target, {"method": "ngram", "num_speculative_tokens": 8}, PROMPTS[:1], PARAMS[:1])
    assert got == plain[:1]
    seq_tokens = len(got[0])
    assert engine.stats.target_passes <= 0.6 * seq_tokens
    assert engine.stats.num_accepted_tokens >= 0.4 * seq_tokens


def test_grammar_rolls_back_rejected_drafts(json_target, json_pair, plain):
    """After each step the matcher holds exactly the committed tokens: a fresh matcher fed the output
    agrees with it (it allows the same tokens next)."""
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": str(json_pair[1]), "num_speculative_tokens": 4})
    engine = Engine(json_target, build_proposer(cfg, json_target, 1, 133), 4, max_batch_size=1, max_model_len=128)
    seq = engine.add_request(PROMPTS[0], constrained())
    while not seq.finished:
        engine.step()
        fresh = engine.grammars.state(StructuredOutputsParams(json=SCHEMA))
        for t in seq.output_ids:
            fresh.commit(t)
        if not seq.finished:
            assert torch.equal(fresh.allowed(), seq.grammar.allowed())
    assert seq.output_ids == plain[0]


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "foo"}}}), "Invalid type"),
    (StructuredOutputsParams(json={"type": "object", "if": {"type": "object"}}), "if"),
    (StructuredOutputsParams(json={"type": "string", "format": "no-such-format"}), "format"),
    (StructuredOutputsParams(json="{not json"), "invalid json"),
    (StructuredOutputsParams(regex="(unclosed"), "regex"),
])
def test_bad_grammar_is_refused_with_its_reason(json_target, spec, reason):
    engine = Engine(json_target, max_batch_size=1, max_model_len=128)
    with pytest.raises(SpeculantError, match=reason):
        engine.add_request(PROMPTS[0], SamplingParams(structured_outputs=spec))
    assert not engine.scheduler.waiting
    # A later request's grammar refused withdraws the earlier ones of the same call.
    with pytest.raises(SpeculantError, match=reason):
        engine.add_requests([(PROMPTS[0], SamplingParams()), (PROMPTS[1], SamplingParams(structured_outputs=spec))])
    assert not engine.has_unfinished()


def test_structured_outputs_needs_exactly_one_kind():
    with pytest.raises(SpeculantError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(SpeculantError, match="exactly one"):
        StructuredOutputsParams()


def test_compiled_grammars_are_cached_per_schema(json_target):
    compiler = GrammarCompiler(json_target.tokenizer, json_target.config.vocab_size, json_target.eos_token_ids)
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=dict(SCHEMA))) is first
    assert compiler.compile(StructuredOutputsParams(json_object=True)) is not first


# -- the distribution under a grammar --------------------------------------------------------------------

# Each token of the 8 one character long: after "a" only "b" may follow, after "x" only "y" or "z".
LETTERS = ["a", "<s>", "</s>", "b", "c", "x", "y", "z"]
GRAMMAR = StructuredOutputsParams(regex="(ab|ba|c|x[yz])+")


@pytest.fixture(scope="module")
def letters_pair(small_vocab_pair, tmp_path_factory):
    """test_distribution's vocabulary-of-8 pair, with a tokenizer whose tokens are letters."""
    root = tmp_path_factory.mktemp("letters")
    loaded = []
    for name, src in zip(("target", "draft"), small_vocab_pair):
        folder = root / name
        shutil.copytree(src, folder)
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(LETTERS)}, []))
        tok.add_special_tokens(["<s>", "</s>"])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        loaded.append(load_model(folder))
    return loaded


def exact_constrained_joint(target, params: SamplingParams, n_tokens: int) -> dict[tuple, float]:
    """P(answer's first n tokens | prompt) under the grammar and the transforms, by enumeration; an answer
    that ends (EOS, or a grammar allowing nothing more) earlier is a shorter tuple."""
    compiler = GrammarCompiler(target.tokenizer, target.config.vocab_size, target.eos_token_ids)
    model = target.model
    sb = SamplingBatch.build([params], [None], model.device)
    joint, done = {(): 1.0}, {}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, mass in joint.items():
            grammar = compiler.state(GRAMMAR)
            for t in prefix:
                grammar.commit(t)
            cache = model.new_cache(1, len(PROMPT) + n_tokens)
            logits = model.logits(model(torch.tensor([PROMPT + list(prefix)]), cache, torch.tensor([0]))[:, -1:])
            p = probabilities(constrain(logits, grammar.allowed()[None, None]), sb)[0, 0]
            for tok in torch.nonzero(p).flatten().tolist():
                grammar.push(tok)
                ends = tok in target.eos_token_ids or grammar.stopped
                grammar.settle()
                (done if ends else nxt)[prefix + (tok,)] = mass * float(p[tok])
        joint = nxt
    return {**joint, **done}


def sampled_constrained(engine: Engine, params: SamplingParams, n: int) -> Counter:
    counts: Counter = Counter()
    for start in range(0, n, BATCH):
        seqs = [engine.add_request(PROMPT, replace(params, seed=start + i, max_tokens=N_TOKENS,
                                                   structured_outputs=GRAMMAR))
                for i in range(min(BATCH, n - start))]
        engine.generate(seqs)
        assert all(s.finish_reason in ("stop", "length") for s in seqs)
        counts.update(tuple(s.output_ids) for s in seqs)
    return counts


def draft_engine(pair, proposer_cls=DraftModelProposer, k: int = 2) -> Engine:
    target, draft = pair
    return Engine(target, proposer_cls(draft, target.config.vocab_size, BATCH, 64), k,
                  max_batch_size=BATCH, max_model_len=32)


@pytest.mark.parametrize("setting", ["t1", pytest.param("t0.7_topk", marks=pytest.mark.slow)])
def test_draft_model_under_a_grammar_follows_the_target(letters_pair, setting):
    params = SETTINGS[setting]
    exact = exact_constrained_joint(letters_pair[0], params, N_TOKENS)
    assert any(len(c) < N_TOKENS for c in exact) and len(exact) > 8  # some answers end early; enough outcomes
    engine = draft_engine(letters_pair)
    p = g_test(sampled_constrained(engine, params, N_SAMPLES), exact)
    print(f"{setting}: G-test p = {p:.4f}")
    assert p > ALPHA
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("native_sampler", [pytest.param(True, marks=pytest.mark.slow), False])
def test_lookup_drafts_under_a_grammar_follow_the_target(letters_pair, native_sampler, monkeypatch):
    """Deterministic drafts (and the grammar's forced tokens) by coupling, on both samplers."""
    from speculant.models import native

    if native_sampler and not native.sampling_usable(torch.zeros(1)):
        pytest.skip("the native sampler does not run here (no AVX2, or no compiler)")
    if not native_sampler:
        monkeypatch.setattr(native, "sampling_usable", lambda x: False)
    params = SETTINGS["t1"]
    engine = Engine(letters_pair[0], NgramProposer(1, 3), 3, max_batch_size=BATCH, max_model_len=32)
    exact = exact_constrained_joint(letters_pair[0], params, N_TOKENS)
    p = g_test(sampled_constrained(engine, params, N_SAMPLES), exact)
    print(f"native {native_sampler}: G-test p = {p:.4f}")
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA


def test_mask_on_the_target_only_is_caught(letters_pair):
    """The draft samples under the grammar but reports q without it: acceptance p/q is then wrong."""
    params = SETTINGS["t1"]
    p = g_test(sampled_constrained(draft_engine(letters_pair, GrammarOnTargetOnly), params, N_SAMPLES),
               exact_constrained_joint(letters_pair[0], params, N_TOKENS))
    print(f"mask on the target only: G-test p = {p:.2e}")
    assert p < ALPHA


def test_stale_mask_along_drafts_is_caught(letters_pair, monkeypatch):
    """Every draft position masked at the committed state, not after the drafts before it."""
    patch_grammar("mask_at_committed_state", monkeypatch)
    params = SETTINGS["t1"]
    engine = draft_engine(letters_pair)
    counts: Counter = Counter()
    for start in range(0, N_SAMPLES, BATCH):
        seqs = [engine.add_request(PROMPT, replace(params, seed=start + i, max_tokens=N_TOKENS,
                                                   structured_outputs=GRAMMAR)) for i in range(BATCH)]
        engine.generate(seqs)
        counts.update(tuple(s.output_ids) if s.finish_reason != "error" else ("error",) for s in seqs)
    p = g_test(counts, exact_constrained_joint(letters_pair[0], params, N_TOKENS))
    print(f"stale mask: G-test p = {p:.2e}")
    assert p < ALPHA
