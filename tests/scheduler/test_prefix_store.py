"""The prefix cache on disk (prefix_store.py): a fresh engine on the same folder reads the prefix an earlier one
wrote and answers exactly as a cold prefill does (tokens and log-probabilities, bit for bit); a file that is cut
short, flipped, garbage or another model's is skipped and changes no answer; the folder holds at most its bound,
the least recently used dropped; the mutants (a key blind to the model file or to how the weights compute, no
checksum check) are caught."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_tiny, transformers

import speculant.prefix_store as prefix_store
from speculant.arguments import engine_config_from_args
from speculant.cli import build_parser
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.kernels import inexact_reason
from speculant.models.kv_cache import KVCache
from speculant.models.loader import load_model
from speculant.prefix_cache import PrefixCache
from speculant.prefix_store import PrefixStore, parse_header
from speculant.proposers import build_proposer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=6, ignore_eos=True, logprobs=3)
BUDGET = 16 << 20
PATHS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("store")
    return {"small": save_tiny(root / "small", seed=5, num_hidden_layers=3),
            "other": save_tiny(root / "other", seed=7, num_hidden_layers=3),  # the same shapes, other weights
            "draft": save_tiny(root / "draft", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)}


def fresh(folder: Path, cache_dir: Path | None, dtype: str = "float32", quant: str | None = None) -> Engine:
    """A restarted process: the model loaded again, a new engine, the same folder."""
    target = load_model(folder, dtype=dtype, quantization=quant)
    engine = Engine(target, None, 0, max_batch_size=2, max_model_len=256, prefix_cache_bytes=BUDGET,
                    prefix_cache_dir=None if cache_dir is None else str(cache_dir))
    if engine.prefix_cache is None:
        pytest.skip(f"no prefix cache here: {inexact_reason(target.model, target.model.device)}")
    return engine


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    seq = engine.add_request(prompt, params)
    engine.generate([seq])
    if engine.prefix_cache is not None and engine.prefix_cache.disk is not None:
        engine.prefix_cache.disk.flush()
    return seq


def result(seq) -> tuple:
    """What must not change: the tokens, and each token's log-probability and top alternatives, bit for bit."""
    return seq.output_ids, [(lp.logprob, lp.top) for lp in seq.logprobs]


_COLD: dict = {}


def cold(folder: Path, prompt: list[int], params: SamplingParams = GREEDY, **load) -> tuple:
    """A cold prefill's answer (no prefix cache at all), computed once a module."""
    key = (str(folder), tuple(prompt), params.temperature, tuple(sorted(load.items())))
    if key not in _COLD:
        target = load_model(folder, dtype=load.get("dtype", "float32"), quantization=load.get("quant"))
        engine = Engine(target, None, 0, max_batch_size=2, max_model_len=256, prefix_cache_bytes=0)
        _COLD[key] = result(run(engine, prompt, params))
    return _COLD[key]


FIRST = [random.Random(1).randrange(3, 96) for _ in range(40)]


def two_turns(folder: Path, cache_dir: Path, params: SamplingParams = GREEDY, **load) -> tuple[list[int], object]:
    """Turn one on an engine that writes `cache_dir`; → the second turn's prompt and a fresh engine's answer."""
    turn1 = run(fresh(folder, cache_dir, **load), FIRST, params).output_ids
    second = FIRST + turn1 + [7, 8, 9]
    return second, run(fresh(folder, cache_dir, **load), second, params)


def check_equals_cold(folder, cache_dir, params=GREEDY, hit: bool = True, **load) -> None:
    second, warm = two_turns(folder, cache_dir, params, **load)
    assert result(warm) == cold(folder, second, params, **load)
    assert (warm.cached_tokens >= len(FIRST)) if hit else warm.cached_tokens == 0


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_hit_after_a_restart_equals_cold(folders, tmp_path, path, params):
    dtype, quant = PATHS[path]
    check_equals_cold(folders["small"], tmp_path, params, dtype=dtype, quant=quant)


def test_a_draft_model_starts_cold_beside_a_target_from_disk(folders, tmp_path):
    """Only the target's cache goes to disk: after a restart the draft prefills the whole prompt itself, and the
    answer is plain greedy's."""
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(folders["draft"]),
                                    "num_speculative_tokens": 3})

    def engine() -> Engine:
        target = load_model(folders["small"], dtype="float32")
        proposer = build_proposer(spec, target, 2, 256 + 4)
        return Engine(target, proposer, 3, max_batch_size=2, max_model_len=256, prefix_cache_bytes=BUDGET,
                      prefix_cache_dir=str(tmp_path))

    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = engine()
    if first.prefix_cache is None:
        pytest.skip("no prefix cache here")
    turn1 = run(first, FIRST, plain).output_ids
    second = FIRST + turn1 + [7, 8]
    warm = run(engine(), second, plain)
    assert warm.cached_tokens >= len(FIRST)
    assert warm.output_ids == cold(folders["small"], second, GREEDY)[0]


def only_file(cache_dir: Path) -> Path:
    files = list(cache_dir.rglob("*.safetensors"))
    assert len(files) == 1
    return files[0]


def truncate(at):
    return lambda data: data[:at(len(data))]


def flip(region: str, n: int, seed: int):
    """`n` random bits flipped in the header, the data, or the keys alone."""
    def spoil(data: bytes) -> bytes:
        header, start = parse_header(data)
        lo, hi = {"header": (0, start), "data": (start, len(data)),
                  "keys": tuple(start + x for x in header["k"]["data_offsets"])}[region]
        out, rng = bytearray(data), random.Random(seed)
        for _ in range(n):
            out[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        return bytes(out)
    return spoil


SPOILERS = {
    "empty": lambda data: b"",
    "cut-in-header": truncate(lambda n: 40),
    "cut-in-data": truncate(lambda n: n // 2),
    "last-byte-gone": truncate(lambda n: n - 1),
    "garbage": lambda data: random.Random(3).randbytes(len(data)),
    "huge-header-length": lambda data: (2**62).to_bytes(8, "little") + data[8:],
    **{f"header-bit-{s}": flip("header", 1, s) for s in range(3)},
    **{f"data-bit-{s}": flip("data", 1, s) for s in range(3)},
    "data-bits-64": flip("data", 64, 9),
    "keys-bits-64": flip("keys", 64, 9),
}


@pytest.fixture(scope="module")
def written(folders, tmp_path_factory) -> tuple[list[int], Path, bytes]:
    """A first turn's answer, and the file it left: where it lies in its folder, and its bytes."""
    root = tmp_path_factory.mktemp("written")
    turn1 = run(fresh(folders["small"], root), FIRST).output_ids
    file = only_file(root)
    return turn1, file.relative_to(root), file.read_bytes()


@pytest.mark.parametrize("spoil", list(SPOILERS))
def test_a_spoiled_file_is_skipped_and_changes_no_answer(folders, written, tmp_path, caplog, spoil):
    turn1, where, data = written
    file = tmp_path / where
    file.parent.mkdir(parents=True)
    file.write_bytes(SPOILERS[spoil](data))
    second = FIRST + turn1 + [7, 8, 9]
    with caplog.at_level(logging.WARNING, logger="speculant"):
        warm = run(fresh(folders["small"], tmp_path), second)
    assert result(warm) == cold(folders["small"], second)
    assert warm.cached_tokens == 0
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    if spoil == "data-bits-64":  # flipped tokens too: the file may no longer claim this prompt, and go unread
        assert len(skipped) <= 1
        return
    assert len(skipped) == 1 and file.name in skipped[0] and "\n" not in skipped[0]
    assert not file.exists()  # removed: it could never be read


def test_another_models_file_is_skipped(folders, tmp_path, caplog):
    """A file of the model with other weights, moved into this model's folder: its header names another model."""
    other = tmp_path / "other"
    run(fresh(folders["other"], other), FIRST)
    engine = fresh(folders["small"], tmp_path / "mine")
    stranger = only_file(other)
    shutil.copy(stranger, engine.prefix_cache.disk.folder / stranger.name)
    second = FIRST + [11, 12]
    with caplog.at_level(logging.WARNING, logger="speculant"):
        warm = run(fresh(folders["small"], tmp_path / "mine"), second)
    assert result(warm) == cold(folders["small"], second)
    assert warm.cached_tokens == 0 and "another model identity" in caplog.text


# -- the mutants ---------------------------------------------------------------------------------


def check_other_model(folders, cache_dir) -> None:
    """The model with other weights writes a conversation's first turn; this one's second turn reads nothing."""
    turn1 = run(fresh(folders["other"], cache_dir), FIRST).output_ids
    second = FIRST + turn1 + [7]
    warm = run(fresh(folders["small"], cache_dir), second)
    assert result(warm) == cold(folders["small"], second)
    assert warm.cached_tokens == 0


def test_a_key_blind_to_the_model_file_is_caught(folders, tmp_path, monkeypatch):
    check_other_model(folders, tmp_path / "real")
    monkeypatch.setattr(prefix_store, "model_files", lambda source: "any model")
    with pytest.raises(AssertionError):
        check_other_model(folders, tmp_path / "mutant")


def check_int8_then_fp32(folder, cache_dir) -> None:
    turn1 = run(fresh(folder, cache_dir, quant="int8"), FIRST).output_ids
    second = FIRST + turn1 + [7]
    warm = run(fresh(folder, cache_dir), second)
    assert result(warm) == cold(folder, second) and warm.cached_tokens == 0


def test_a_key_blind_to_how_the_weights_compute_is_caught(folders, tmp_path, monkeypatch):
    """int8 weights and full-precision ones give keys of one shape and dtype, and other numbers."""
    check_int8_then_fp32(folders["small"], tmp_path / "real")
    identity = prefix_store.model_identity
    blind = ("dtype", "quantization", "layers")
    monkeypatch.setattr(prefix_store, "model_identity",
                        lambda target, cache: {k: v for k, v in identity(target, cache).items() if k not in blind})
    with pytest.raises(AssertionError):
        check_int8_then_fp32(folders["small"], tmp_path / "mutant")


def test_no_checksum_check_is_caught(folders, written, tmp_path, monkeypatch):
    """The checksum not compared: a file with flipped keys is served, and the answer changes."""
    monkeypatch.setattr(prefix_store, "intact", lambda tensors, meta: True)
    turn1, where, data = written
    (tmp_path / where).parent.mkdir(parents=True)
    (tmp_path / where).write_bytes(SPOILERS["keys-bits-64"](data))
    second = FIRST + turn1 + [7, 8, 9]
    warm = run(fresh(folders["small"], tmp_path), second)
    assert warm.cached_tokens > 0 and result(warm) != cold(folders["small"], second)


# -- the folder ----------------------------------------------------------------------------------


def tiny_cache() -> KVCache:
    cache = KVCache(2, 2, 1, 64, 4, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    return cache


IDENTITY = {"format": prefix_store.FORMAT, "model": "tiny"}


def test_the_folder_holds_its_bound_the_least_recently_used_dropped(tmp_path):
    cache = tiny_cache()
    file_bytes = 20 * cache.row_bytes_per_token + 20 * 8 + 400  # keys, values, tokens, header
    store = PrefixStore(tmp_path, IDENTITY, int(2.5 * file_bytes), cache)
    memory = PrefixCache(1 << 20, disk=store)
    for first in (1, 2, 3):
        memory.store([first] * 20, cache, 0)
    store.flush()
    assert {int(e.tokens[0]) for e in store.entries} == {2, 3} and store.nbytes <= store.capacity_bytes
    assert len(list(store.folder.glob("*.safetensors"))) == 2
    # A restart sees the same two, in the same order of use; reading 2 makes 3 the least recently used.
    again = PrefixStore(tmp_path, IDENTITY, store.capacity_bytes, cache)
    assert {int(e.tokens[0]) for e in again.entries} == {2, 3}
    cold = PrefixCache(1 << 20, disk=again)
    assert cold.load([3] * 3 + [5], cache, 1) == 0  # 3 tokens are not worth reading a file for
    assert cold.load([2] * 21, cache, 1) == 20 and torch.equal(cache.k[:, 1, :, :20], cache.k[:, 0, :, :20])
    cold.store([4] * 20, cache, 0)
    again.flush()
    assert {int(e.tokens[0]) for e in again.entries} == {2, 4}
    assert len(list(again.folder.glob("*.safetensors"))) == 2


def test_the_default_bound_is_taken_where_the_folder_will_be(tmp_path):
    assert prefix_store.default_disk_bytes(tmp_path / "not" / "made" / "yet") > 0


def test_a_next_turn_replaces_its_first_turns_file(tmp_path):
    cache = tiny_cache()
    store = PrefixStore(tmp_path, IDENTITY, 1 << 20, cache)
    memory = PrefixCache(1 << 20, disk=store)
    memory.store(list(range(10)), cache, 0)
    memory.store(list(range(20)), cache, 0)
    store.flush()
    assert [len(e.tokens) for e in store.entries] == [20]
    assert len(list(store.folder.glob("*.safetensors"))) == 1


def test_an_unusable_folder_or_a_full_disk_is_one_line(folders, tmp_path, caplog, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="speculant"):
        engine = fresh(folders["small"], blocker / "cache")
    assert engine.prefix_cache.disk is None and "prefix cache on disk is off" in caplog.text
    assert result(run(engine, FIRST)) == cold(folders["small"], FIRST)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prefix_store, "save_file", full)
    caplog.clear()
    engine = fresh(folders["small"], tmp_path / "full")
    with caplog.at_level(logging.WARNING, logger="speculant"):
        for tail in ([4], [5], [6]):
            run(engine, FIRST + tail)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and "No space left" in failures[0].getMessage()
    assert not list((tmp_path / "full").rglob("*.safetensors*"))
    assert engine.prefix_cache.stats.hits > 0  # the memory tier goes on


# -- hybrid models: their recurrent states go to disk too -----------------------------------------


def test_a_hybrid_models_states_come_back_from_disk(tmp_path):
    config_cls = getattr(transformers, "Qwen3_5TextConfig", None)
    if config_cls is None:
        pytest.skip("this transformers has no Qwen3.5")
    folder = save_tiny(tmp_path / "hybrid", config_cls, seed=3, vocab_size=96, hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=4, init_std=0.1,
                       intermediate_size=96, tie_word_embeddings=False)
    first = FIRST[:24]
    run(fresh(folder, tmp_path / "cache"), first)
    assert any(name.startswith("state.") for name in prefix_store.read_header(only_file(tmp_path / "cache"))[0])
    second = first[:-1] + [7, 7, 9, 7, 7, 9, 31]  # from the state stored at the first prompt's end
    warm = run(fresh(folder, tmp_path / "cache"), second)
    assert warm.cached_tokens == len(first) - 1
    assert result(warm) == cold(folder, second)


# -- the ways in ---------------------------------------------------------------------------------


def test_the_flags_and_llm_reach_the_engine(folders, tmp_path):
    from speculant.llm import LLM

    parse = build_parser().parse_args
    base = ["generate", "hi", "--model", str(folders["small"])]
    config = engine_config_from_args(parse([*base, "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk-gb",
                                            "0.5"]))
    assert (config.prefix_cache_dir, config.prefix_cache_disk_bytes) == (str(tmp_path), 2**29)
    served = engine_config_from_args(parse(["serve", "--model", str(folders["small"]), "--prefix-cache-dir", "d"]))
    assert (served.prefix_cache_dir, served.prefix_cache_disk_bytes) == ("d", None)
    with pytest.raises(SpeculantError, match="give that too"):
        engine_config_from_args(parse([*base, "--prefix-cache-disk-gb", "1"]))
    with pytest.raises(SpeculantError, match="drop --no-enable-prefix-caching"):
        engine_config_from_args(parse([*base, "--prefix-cache-dir", "x", "--no-enable-prefix-caching"]))
    llm = LLM(str(folders["small"]), dtype="float32", speculative_config=None, prefix_cache_dir=tmp_path,
              prefix_cache_disk_bytes=1 << 24)
    if llm.engine.prefix_cache is None:
        pytest.skip("no prefix cache here")
    assert llm.engine.prefix_cache.disk.capacity_bytes == 1 << 24
    assert llm.engine.prefix_cache.disk.folder.parent == tmp_path
