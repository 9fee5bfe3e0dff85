"""A draft model's cheaper drafting rules keep the output exact: a reduced draft vocabulary and stopping where
the draft is unsure of its next token (p_min) or of its whole draft (p_chain). Greedy output equals plain
greedy output; sampled output follows the target's distribution (the G-test of test_distribution.py at the
same significance); a mutant of each rule is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from mutants import DRAFT_RULE_MUTANTS
from test_distribution import (
    ALPHA,
    BATCH,
    N_SAMPLES,
    N_TOKENS,
    SETTINGS,
    exact_joint,
    g_test,
    sampled_joint,
)
from test_greedy_lossless import PROMPTS, run

from speculant.config import SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers.draft_model import DraftModelProposer
from speculant.proposers.draft_vocab import HeadRows, draft_vocab_ids
from speculant.sampling import SamplingBatch

# Seeded requests here are judged as unseeded ones are (conftest.rule_path): the acceptance rule's path.
pytestmark = pytest.mark.usefixtures("rule_path")

# Where the small-vocabulary draft stops at about half its positions (its likeliest token's probability there).
P_MIN = 0.45
P_CHAIN = 0.2  # where it drafts about 40% fewer of the positions past the first; its mutant is caught here
SMALL_VOCAB = 5  # of 8


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


@pytest.fixture(scope="module")
def plain(target):
    return run(target, None, PROMPTS)[0]


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("rule", [{"draft_vocab_size": 40}, {"draft_p_min": 0.0137}, {"draft_p_chain": 1e-4},
                                  {"draft_vocab_size": 64, "draft_p_min": 0.0135, "lookup_first": True}])
def test_greedy_equals_plain(target, tiny_pair, plain, rule, k):
    spec = {"method": "draft_model", "num_speculative_tokens": k, "model": str(tiny_pair[1]), **rule}
    one_by_one = [run(target, spec, [p], max_batch_size=1)[0][0] for p in PROMPTS]
    batched, engine = run(target, spec, PROMPTS)
    assert one_by_one == plain
    assert batched == plain
    assert engine.stats.num_draft_tokens > 0


@pytest.mark.filterwarnings("ignore:the draft model")  # a draft as large as its target: warned, and still exact
def test_the_target_as_its_own_draft_with_every_rule_still_accepts(target, tiny_pair):
    # Its own argmax lies in the reduced vocabulary at most steps: drafts there are all accepted.
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(tiny_pair[0]),
            "draft_vocab_size": 90, "draft_p_min": 0.0137}
    _, engine = run(target, spec, PROMPTS)
    assert engine.stats.num_accepted_tokens > 0.5 * engine.stats.num_draft_tokens


def test_p_min_stops_drafts_short(target, tiny_pair):
    spec = {"method": "draft_model", "num_speculative_tokens": 5, "model": str(tiny_pair[1])}
    _, full = run(target, spec, PROMPTS)
    _, short = run(target, {**spec, "draft_p_min": 0.0137}, PROMPTS)
    assert 0 < short.stats.num_draft_tokens < full.stats.num_draft_tokens


def test_p_chain_stops_drafts_shorter_than_its_p_min_alone(target, tiny_pair):
    # The chain multiplies its drafts' probabilities: on a model unsure of every token, a bound as high as a p_min
    # ends drafts sooner.
    spec = {"method": "draft_model", "num_speculative_tokens": 5, "model": str(tiny_pair[1])}
    _, p_min = run(target, {**spec, "draft_p_min": 0.0137}, PROMPTS)
    _, chain = run(target, {**spec, "draft_p_chain": 0.0137}, PROMPTS)
    assert 0 < chain.stats.num_draft_tokens < p_min.stats.num_draft_tokens


def test_head_rows_are_the_heads_logits_at_those_ids(target, smollm_path):
    bundled = load_model(smollm_path, dtype="auto", quantization="auto")
    # The ggml kernel computes each output alone: exact; a dense matmul's blocking may move the last bit.
    for model, tol in ((target.model, 1e-6), (bundled.model, 0.0)):
        ids = draft_vocab_ids(50, model.cfg.vocab_size, [model.cfg.vocab_size - 1])
        rows = HeadRows(model.lm_head, ids)
        assert set(ids.tolist()) <= set(rows.ids.tolist())
        hidden = torch.randn(3, 1, model.cfg.dim, dtype=model.dtype)
        full = model.lm_head(hidden).float()
        torch.testing.assert_close(rows(hidden).float(), full.index_select(-1, rows.ids), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def small(small_vocab_pair):
    target, draft = small_vocab_pair
    return load_model(target), load_model(draft)


def rule_engine(models, proposer_cls=DraftModelProposer, **rule) -> Engine:
    target, draft = models
    proposer = proposer_cls(draft, target.config.vocab_size, BATCH, 64, **rule)
    # Drafts from the first token on: with 3 tokens a sample, the rules at draft positions 1 and 2 need them.
    return Engine(target, proposer, 3, max_batch_size=BATCH, max_model_len=32, first_token_alone=False)


# At P_CHAIN with the small vocabulary the chain ends where p_min does: "all" takes a bound that ends it elsewhere.
RULES = {"vocab": {"vocab_size": SMALL_VOCAB}, "p_min": {"p_min": P_MIN}, "p_chain": {"p_chain": P_CHAIN},
         "both": {"vocab_size": SMALL_VOCAB, "p_min": P_MIN}, "all": {"vocab_size": SMALL_VOCAB, "p_chain": 0.3}}


@pytest.mark.parametrize("rule, setting", [("vocab", "t1"), ("p_min", "t1"), ("p_chain", "t1"), ("both", "t0.7_topk"),
                                           ("all", "t0.7_topk")])
def test_sampling_matches_target(small, rule, setting):
    engine = rule_engine(small, **RULES[rule])
    params = SETTINGS[setting]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(small[0].model, params, N_TOKENS))
    drafted = engine.stats.num_draft_tokens / (N_SAMPLES * N_TOKENS)
    print(f"{rule}, {setting}: G-test p = {p:.4f}, {drafted:.2f} drafts a token")
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA


def test_p_min_leaves_positions_undrafted(small):
    def drafted(engine):
        params = replace(SETTINGS["t1"], max_tokens=12, ignore_eos=True)
        engine.generate([engine.add_request([1, 5, 3, 6, 1, 5], replace(params, seed=i)) for i in range(BATCH)])
        return engine

    full = drafted(rule_engine(small))
    for rule in ({"p_min": P_MIN}, {"p_chain": P_CHAIN}):
        engine = drafted(rule_engine(small, **rule))
        # Fewer drafts, yet some: the rule is active, and not on every position.
        assert 0.2 * full.stats.num_draft_tokens < engine.stats.num_draft_tokens < 0.8 * full.stats.num_draft_tokens


@pytest.mark.parametrize("mutant", list(DRAFT_RULE_MUTANTS))
def test_draft_rule_mutant_is_caught(small, mutant):
    cls, rule = DRAFT_RULE_MUTANTS[mutant]
    engine = rule_engine(small, cls, **rule)
    params = SETTINGS["t1"]
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(small[0].model, params, N_TOKENS))
    print(f"{mutant}: G-test p = {p:.2e}")
    assert p < ALPHA


@pytest.mark.parametrize("bad, why", [
    ({"draft_vocab_size": -1}, "draft_vocab_size"), ({"draft_vocab_size": 1.5}, "draft_vocab_size"),
    ({"draft_p_min": 1.0}, "draft_p_min"), ({"draft_p_min": "high"}, "draft_p_min"),
    ({"method": "ngram", "draft_p_min": 0.5}, "need method draft_model"),
    ({"draft_p_chain": -0.1}, "draft_p_chain"), ({"method": "ngram", "draft_p_chain": 0.5}, "need method draft_model"),
])
def test_invalid_rule_settings_are_refused(bad, why):
    config = {"method": "draft_model", "model": "x", "num_speculative_tokens": 4, **bad}
    with pytest.raises(SpeculantError, match=why):
        SpeculativeConfig.parse(config)


def test_a_requantized_gguf_draft_holds_gguf_s_q4_0_values_and_keeps_greedy_output(smollm_path, tmp_path,
                                                                                   monkeypatch):
    """A draft's wider matrices as Q4_0: each weight is gguf's Q4_0 of the file's value (its own quantizer,
    dequantized), in a cache of its own; the target, the file as stored, decodes as without speculation."""
    import gguf

    from speculant.config import SamplingParams
    from speculant.models import gguf_native

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    reader = gguf.GGUFReader(smollm_path)
    t = next(t for t in reader.tensors if t.tensor_type in gguf_native.WIDER and len(t.shape) == 2)
    qtype, raw = gguf_native.stored_rows(t, slice(0, 16), requantize=True)
    assert qtype == gguf.GGMLQuantizationType.Q4_0
    from speculant.models import ggml

    expected = gguf.quants.dequantize(gguf.quants.quantize(gguf.quants.dequantize(t.data[:16], t.tensor_type),
                                                           qtype), qtype)
    assert (ggml.decode(qtype, raw, 16, int(t.shape[0])).dequantize() == expected).all()

    target = load_model(smollm_path, dtype="auto", quantization="auto")
    draft = load_model(smollm_path, dtype="auto", quantization="auto", requantize_q4_0=True)
    assert gguf_native.cache_folder(smollm_path, True).name.endswith("-q4_0")
    assert {m.weights[6][0].item() for m in draft.model.modules() if hasattr(m, "weights")} == {4}
    prompt = target.tokenizer.encode_chat([{"role": "user", "content": "Name three prime numbers."}])
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = Engine(target, max_batch_size=1, max_model_len=128)
    expected_ids = plain.generate([plain.add_request(prompt, params)])[0].output_ids
    engine = Engine(target, DraftModelProposer(draft, target.config.vocab_size, 1, 160, p_min=0.3), 4,
                    max_batch_size=1, max_model_len=128)
    assert engine.generate([engine.add_request(prompt, params)])[0].output_ids == expected_ids
    assert engine.stats.num_accepted_tokens > 0


def test_draft_quantization_needs_a_gguf_draft():
    with pytest.raises(SpeculantError, match="draft_quantization requantizes a GGUF draft's blocks"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "a/folder", "num_speculative_tokens": 4,
                                 "draft_quantization": "q4_0"})
    with pytest.raises(SpeculantError, match="choose \"q4_0\""):
        SpeculativeConfig.parse({"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 4,
                                 "draft_quantization": "q2"})


class AllowsOnly:
    """A grammar state that allows only `ids` next (the seam draw() reads: vocab_size, bitmask, push)."""

    def __init__(self, ids: list[int], vocab_size: int):
        self.vocab_size, self.pushed = vocab_size, []
        bits = bytearray((vocab_size + 7) // 8)
        for i in ids:
            bits[i // 8] |= 1 << (i % 8)
        self.mask = bytes(bits)

    def bitmask(self) -> bytes:
        return self.mask

    def push(self, token: int) -> bool:
        self.pushed.append(token)
        return False


def ready_proposer(models, prompt: list[int], params, **rule) -> tuple[Engine, object]:
    """An engine whose draft has read `prompt` (one plain step run) → (engine, its sequence)."""
    target, draft = models
    engine = Engine(target, DraftModelProposer(draft, target.config.vocab_size, 2, 64, **rule), 3,
                    max_batch_size=2, max_model_len=32)
    seq = engine.add_request(prompt, replace(params, max_tokens=8, ignore_eos=True))
    engine.step()
    return engine, seq


def test_a_grammar_beyond_the_draft_vocabulary_gives_a_finite_q(small):
    """The grammar allows ids 6 and 7 alone, the reduced draft scores 0..4: the draft's masked row would be all
    −inf (a NaN q). It is left unmasked instead, so the draft draws a token of its vocabulary with a finite q
    (the engine then cuts that draft: drop_forbidden)."""
    engine, seq = ready_proposer(small, [1, 5, 3, 6, 1, 5], replace(SETTINGS["t1"], seed=3), vocab_size=SMALL_VOCAB)
    grammar = AllowsOnly([6, 7], 8)
    sb = SamplingBatch.build([seq.params], [seq.key], engine.device, [seq.num_generated], [grammar])
    out = engine.proposer.propose([seq], [3], sb)
    assert set(out.tokens[0].tolist()) <= set(range(SMALL_VOCAB))
    assert grammar.pushed
    assert out.q is not None and torch.isfinite(out.q).all()
    assert torch.allclose(out.q[0].sum(-1), torch.ones(out.q.shape[1]))


def test_a_chain_ended_everywhere_runs_no_further_head(small):
    """p_chain near 1 ends every draft after its first token: the draft's logits are computed once, and no
    pass feeds the drawn token."""
    engine, seq = ready_proposer(small, [1, 5, 3, 6, 1, 5], SETTINGS["t1"], p_chain=0.999)
    proposer = engine.proposer
    heads, passes = [], []
    logits = proposer._logits
    proposer._logits = lambda hidden: heads.append(1) or logits(hidden)
    hook = proposer.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    sb = SamplingBatch.build([seq.params], [seq.key], engine.device, [seq.num_generated])
    out = proposer.propose([seq], [4], sb)
    hook.remove()
    assert out.n_draft.tolist() == [1]
    assert len(heads) == 1
    assert len(passes) == 1  # the catch-up pass over the unseen token alone
