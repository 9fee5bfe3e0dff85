"""A model without a chat template (a base model) answers the first command: `generate` and `LLM.chat` run its
prompt raw, as --no-chat does, and say so in one line on stderr."""

from __future__ import annotations

import pytest
from conftest import save_tiny
from test_seed_configs import with_tokenizer

from speculant import LLM, SamplingParams
from speculant.cli import main

RAW_LINE = "speculant: this model has no chat template: the prompt runs raw, as with --no-chat"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return with_tokenizer(save_tiny(tmp_path_factory.mktemp("base") / "m", seed=4))


def test_generate_runs_a_base_model_raw_with_one_line(base_model, capsys):
    args = ["--quiet", "generate", "w5 w9 w5", "--model", str(base_model), "-n", "5", "--ignore-eos"]
    assert main(args + ["--no-chat"]) == 0
    raw = capsys.readouterr()
    assert main(args) == 0
    got = capsys.readouterr()
    assert got.out == raw.out and got.out.strip()
    assert [line for line in got.err.splitlines() if "chat template" in line] == [RAW_LINE]
    assert "chat template" not in raw.err


def test_llm_chat_runs_a_base_model_raw_and_says_so_once(base_model, capsys):
    llm = LLM(str(base_model), speculative_config=None)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate(["w5 w9 w5"], params)[0].token_ids
    assert llm.chat([{"role": "user", "content": "w5 w9 w5"}], params)[0].token_ids == expected
    assert llm.chat([[{"role": "user", "content": "w5 w9 w5"}]], params)[0].token_ids == expected
    assert capsys.readouterr().err.count("no chat template") == 1
