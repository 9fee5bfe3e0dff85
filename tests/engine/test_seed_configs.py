"""The users' own speculative configs, as the seed texts print them, through `generate` and `serve`; every
method name vLLM documents either runs or is refused with one line that says what to pass instead."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys

import httpx
import pytest
import torch
from conftest import save_tiny, wait_until_healthy
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from speculant.cli import main
from speculant.config import METHODS, SpeculativeConfig
from speculant.errors import SpeculantError

# Verbatim from the seed text (vLLM's docs' shape): a same-family draft model, five drafts a step.
SEED_DRAFT = """vllm serve Qwen/Qwen3-32B \\
--speculative-config '{"method": "draft", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 5}'"""
SEED_DRAFT_MODEL = "Qwen/Qwen3-0.6B"
# Verbatim from the seed text: a YAML file for an EAGLE-3 head.
SEED_EAGLE3 = """# vllm serve Qwen/Qwen3-32B --speculative-config
method: eagle3
num_speculative_tokens: 2
"""
VLLM_METHODS = ("ngram", "eagle", "eagle3", "draft_model", "mtp", "suffix", "medusa", "mlp_speculator")
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]


def with_tokenizer(folder):
    """A word-level tokenizer over the tiny models' 96 ids, so that `generate` can read a prompt."""
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    target = with_tokenizer(save_tiny(root / "target", seed=0, num_hidden_layers=3))
    draft = with_tokenizer(save_tiny(root / "draft", seed=1, num_hidden_layers=1, hidden_size=32,
                                     intermediate_size=64))
    return target, draft


def seed_draft_flags(draft) -> list[str]:
    """The seed's `--speculative-config '…'`, as a shell splits it, with the draft model's path swapped in."""
    flags = shlex.split(SEED_DRAFT.replace("\\\n", " "))
    start = flags.index("--speculative-config")
    return [flags[start], flags[start + 1].replace(SEED_DRAFT_MODEL, str(draft))]


def seed_eagle3_file(tmp_path):
    path = tmp_path / "speculative.yaml"
    path.write_text(SEED_EAGLE3)
    return path


@pytest.mark.parametrize("method", VLLM_METHODS + ("draft", "deepseek_mtp"))
def test_every_vllm_method_runs_or_says_what_to_pass(method):
    config = {"method": method, "model": "some/draft", "num_speculative_tokens": 2}
    try:
        cfg = SpeculativeConfig.parse(config)
    except SpeculantError as e:
        message = str(e)
        assert method not in METHODS and "\n" not in message, message
        assert f"method {method!r} is not supported: " in message and "pass" in message, message
    else:
        renamed = {"draft": "draft_model", "deepseek_mtp": "mtp"}
        assert cfg.method in METHODS and cfg.method == renamed.get(method, method)


def test_an_unknown_method_lists_the_ones_that_run():
    with pytest.raises(SpeculantError, match="unknown method 'lookahead'; choose one of draft_model, ngram, eagle"):
        SpeculativeConfig.parse({"method": "lookahead", "num_speculative_tokens": 2})


def test_seed_draft_config_generates(pair, capsys):
    target, draft = pair
    rc = main(["--quiet", "generate", "w5 w9 w5 w9", "--no-chat", "--model", str(target), "-n", "6",
               "--ignore-eos", *seed_draft_flags(draft)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "speculation: draft_model, k=5" in err and "generated 6 tokens" in err, err


def test_seed_eagle3_config_without_a_head_is_one_line_naming_what_to_pass(pair, tmp_path, capsys):
    rc = main(["generate", "w5", "--no-chat", "--model", str(pair[0]), "--speculative-config",
               str(seed_eagle3_file(tmp_path))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: speculative config: method 'eagle3' needs \"model\": the EAGLE-3 head's "
                               "folder"), lines[0]
    assert "speculant train-draft --kind eagle3" in lines[0]


def seed_eagle3_head(target_dir, folder):
    """A random EAGLE-3 head for the tiny target, in SpecForge's form, its fused layers the default ones."""
    from speculant.models.loader import load_model
    from speculant.proposers.eagle3 import default_aux_layers, head_from_target, save_eagle3

    target = load_model(target_dir)
    torch.manual_seed(0)
    head = head_from_target(target.config, default_aux_layers(target.config.n_layers), None)
    save_eagle3(head, folder, dtype=torch.float32)
    return folder


def test_seed_eagle3_config_with_a_head_generates(pair, tmp_path, capsys):
    """The seed's YAML block as written, with a `model` line naming the head, runs: greedy output is plain."""
    path = seed_eagle3_file(tmp_path)
    path.write_text(SEED_EAGLE3 + f"model: {seed_eagle3_head(pair[0], tmp_path / 'head')}\n")
    args = ["--quiet", "generate", "w5 w9 w5 w9", "--no-chat", "--model", str(pair[0]), "-n", "6", "--ignore-eos"]
    assert main(args + ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2})]) == 0
    plain_out = capsys.readouterr().out
    rc = main(args + ["--speculative-config", str(path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "speculation: eagle3, k=2" in captured.err and "generated 6 tokens" in captured.err, captured.err
    assert captured.out == plain_out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_seed_draft_config_serves(pair):
    target, draft = pair
    port = free_port()
    proc = serve(str(target), *seed_draft_flags(draft), "--max-model-len", "256", port=port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base, timeout_s=120, poll_s=0.2)
        body = {"prompt": "w5 w9 w5 w9", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "draft_model, k=5" in err, err


def test_seed_eagle3_config_without_a_head_stops_serve_with_one_line(pair, tmp_path):
    port = free_port()
    proc = serve(str(pair[0]), "--speculative-config", str(seed_eagle3_file(tmp_path)), port=port)
    out, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("error: speculative config: method 'eagle3' needs \"model\"")
