"""LLM() gets the settings `speculant generate` gets: precision, quantization and speculation."""

from __future__ import annotations

import pytest

from speculant import LLM
from speculant.arguments import engine_from_args
from speculant.cli import build_parser
from speculant.engine import Engine


def settings(engine: Engine) -> dict:
    proposer = engine.proposer
    return {"source": engine.target.source, "dtype": engine.model.dtype, "quantization": engine.target.quantization,
            "k": engine.k, "proposer": proposer.name if proposer else None, "adaptive": engine.adaptive is not None,
            "corpus": getattr(proposer, "corpus", None) is not None, "max_batch_size": engine.max_batch_size,
            "max_model_len": engine.max_model_len}


@pytest.fixture(scope="module")
def cli_defaults(smollm_path) -> dict:
    return settings(engine_from_args(build_parser().parse_args(["generate", "a prompt"])))


def test_llm_defaults_are_the_clis(cli_defaults, smollm_path):
    ours = settings(LLM().engine)
    assert ours == cli_defaults
    # what "auto" comes to for the bundled Q4_1 file: its own blocks on the native kernels (else int4), and
    # speculation
    from speculant.models import native

    stored = "gguf" if native.level() != "off" else "int4"
    assert ours["source"] == str(smollm_path) and ours["quantization"] == stored and ours["k"] > 0


def test_llm_and_cli_agree_on_explicit_settings(smollm_path):
    flags = ["generate", "a prompt", "--model", str(smollm_path), "--dtype", "float32", "-q", "none",
             "--no-speculation"]
    cli = settings(engine_from_args(build_parser().parse_args(flags)))
    ours = settings(LLM(str(smollm_path), dtype="float32", quantization="none", speculative_config=None).engine)
    assert ours == cli and ours["quantization"] == "none" and ours["k"] == 0
