"""The one resolver: every way in (the CLI's flags, LLM()'s arguments) goes through config.engine_config to one
frozen, checked EngineConfig, and the engine is built from that alone."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import save_tiny

from speculant.arguments import engine_config_from_args
from speculant.cli import build_parser
from speculant.config import EngineConfig, engine_config
from speculant.errors import SpeculantError
from speculant.llm import engine_from_config


@pytest.mark.parametrize("setting, value, message", [
    ("max_batch_size", 0, "max_batch_size must be at least 1"),
    ("max_model_len", 1, "max_model_len=1 is too small"),
    ("prefix_cache_bytes", -1, "prefix cache's budget must be at least 0"),
    ("prefill_chunk", -4, "prefill chunk must be at least 0"),
])
def test_a_bad_value_is_refused_once_for_every_way_in(setting, value, message):
    with pytest.raises(SpeculantError, match=message):
        engine_config(None, None, **{setting: value})


def test_a_flag_reaches_the_engine_through_the_resolver(tmp_path):
    folder = save_tiny(tmp_path / "tiny", seed=2)
    args = build_parser().parse_args(["generate", "hello", "--model", str(folder), "--dtype", "float32",
                                      "--max-batch-size", "3", "--max-model-len", "96", "--prefill-chunk", "7",
                                      "--ngram", "-k", "3", "--prefix-cache-gb", "0.01"])
    config = engine_config_from_args(args)
    assert isinstance(config, EngineConfig) and config.speculative.num_speculative_tokens == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 4  # decided once: nobody changes it on the way
    engine = engine_from_config(config)
    assert (engine.max_batch_size, engine.max_model_len, engine.k) == (3, 96, 3)
    assert engine.scheduler.prefill_chunk == 7 and engine.prefix_cache_bytes == int(0.01 * 2**30)
    assert engine.cache.max_len == 96 + 3 + 1  # the context and the spare positions a verify pass writes
