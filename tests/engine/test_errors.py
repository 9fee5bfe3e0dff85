"""Bad input gets one precise message (SpeculantError), never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import save_tiny, transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from speculant import LLM, SamplingParams, SpeculantError
from speculant.config import SpeculativeConfig
from speculant.models.loader import load_model


def raises(match: str):
    return pytest.raises(SpeculantError, match=match)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "m")


def copy_with(tiny, tmp_path, edit_config=None, remove=()):
    dst = tmp_path / "copy"
    shutil.copytree(tiny, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    for name in remove:
        (dst / name).unlink()
    return dst


def test_missing_path():
    with raises("model path not found: /no/such/model"):
        load_model("/no/such/model")


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with raises("expected a Hugging Face model folder or a .gguf file"):
        load_model(f)


def test_unsupported_architecture_is_named_with_the_supported_list(tiny, tmp_path):
    folder = copy_with(tiny, tmp_path, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with raises(r"unsupported architecture 'GPT2LMHeadModel'. Supported: LlamaForCausalLM, Mistral"):
        load_model(folder)


def test_config_missing_keys(tiny, tmp_path):
    folder = copy_with(tiny, tmp_path, lambda c: (c.pop("hidden_size"), c.pop("num_hidden_layers")))
    with raises("missing required key\\(s\\): hidden_size, num_hidden_layers"):
        load_model(folder)


def test_unreadable_config(tiny, tmp_path):
    folder = copy_with(tiny, tmp_path)
    (folder / "config.json").write_text("{not json")
    with raises("config.json: cannot read JSON"):
        load_model(folder)


def test_missing_weights_and_pickle_only(tiny, tmp_path):
    folder = copy_with(tiny, tmp_path, remove=["model.safetensors"])
    with raises("no model.safetensors"):
        load_model(folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with raises("only pickle weights"):
        load_model(folder)


def test_corrupt_safetensors(tiny, tmp_path):
    folder = copy_with(tiny, tmp_path)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with raises("cannot read safetensors"):
        load_model(folder)


def test_sharded_index_with_missing_shard(tiny, tmp_path):
    folder = copy_with(tiny, tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with raises("shard\\(s\\) listed in the index are missing: model-00001-of-00002.safetensors"):
        load_model(folder)


def test_sharded_checkpoint_loads(tiny, tmp_path):
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = load_model(tiny, pack=False).model, load_model(tmp_path / "sharded", pack=False).model
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert (p == q).all(), name


def test_bad_device_and_dtype(tiny):
    with raises("unknown dtype 'float8'"):
        load_model(tiny, dtype="float8")
    if not __import__("torch").cuda.is_available():
        with raises("no CUDA GPU is available"):
            load_model(tiny, device="cuda")


@pytest.mark.parametrize("config, message", [
    ('{"method": "lookahead", "num_speculative_tokens": 3}', "unknown method 'lookahead'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 is out of range"),
    ('{"method": "ngram", "num_speculative_tokens": 1000}', "num_speculative_tokens=1000 is out of range"),
    ('{"method": "ngram"}', "num_speculative_tokens \\(an integer\\) is required"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs \"model\""),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_len": 2}', "unknown key\\(s\\) draft_len"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "adaptive": "sometimes"}',
     "adaptive must be true, false or 'batched', got 'sometimes'"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "adaptive": 1}', "adaptive must be true, false or 'batched'"),
    ('{"method": "ngram", "num_speculative_tokens": 3', "invalid JSON"),
    ('/no/such/config.yaml', "no such file"),
    ('[1, 2]', "must be a JSON object"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3, "corpus": "t"}', "corpus .* needs method ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "corpus": 5}', "corpus must be a path, got 5"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "history_tokens": -1}', "history_tokens=-1 is out of range"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "history_tokens": true}', "history_tokens=True is out of range"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "history_tokens": 100000000000}',
     "history_tokens=100000000000 is out of range"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3, "history_tokens": 1000}',
     "history_tokens .* needs method ngram or lookup_first"),
])
def test_invalid_speculative_config(config, message):
    with raises(message):
        SpeculativeConfig.parse(config)


def test_speculative_config_from_yaml_file(tmp_path):
    f = tmp_path / "spec.yaml"
    f.write_text("method: ngram\nnum_speculative_tokens: 5\nprompt_lookup_max: 3\n")
    cfg = SpeculativeConfig.parse(str(f))
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 5, 3)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=2), "min_p"), (dict(top_k=-5), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_parameters(kwargs, name):
    with raises(f"invalid sampling parameter {name}="):
        SamplingParams(**kwargs)


def test_prompt_errors_and_tokenizer_free_model(tiny):
    llm = LLM(str(tiny), max_model_len=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4
    with raises("the prompt has 20 tokens; the context holds 16"):
        llm.generate({"prompt_token_ids": list(range(20))})
    with raises("the prompt is empty"):
        llm.generate({"prompt_token_ids": []})
    with raises("prompt token id 500 is out of the vocabulary"):
        llm.generate({"prompt_token_ids": [500]})
    with raises("no tokenizer.json"):
        llm.generate("text needs a tokenizer")
    # a long request is capped by the context, not refused
    capped = llm.generate({"prompt_token_ids": [1] * 10}, SamplingParams(temperature=0, max_tokens=100,
                                                                          ignore_eos=True))
    assert len(capped[0].token_ids) == 6 and capped[0].finish_reason == "length"


def test_a_refused_prompt_leaves_no_request_behind(tiny):
    """generate([ok, too_long]) raises and leaves the engine as it found it: `ok` is not decoded by a later call."""
    llm = LLM(str(tiny), max_model_len=16, max_batch_size=2)
    params = SamplingParams(temperature=0, max_tokens=4)
    with raises("the prompt has 20 tokens"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(20))}], params)
    with raises("a dict prompt needs 'prompt_token_ids'"):  # refused while reading the prompts
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"text": "x"}], params)
    assert not llm.engine.has_unfinished()
    out = llm.generate([{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [6]}], params)
    assert [len(o.token_ids) for o in out] == [4, 4]
    assert sorted(llm.engine.scheduler.free_slots) == [0, 1] and not llm.engine.has_unfinished()


def test_an_interrupted_generate_withdraws_its_requests(tiny, monkeypatch):
    llm = LLM(str(tiny), max_model_len=16, max_batch_size=2)
    step, calls = llm.engine.step, [0]

    def interrupted():
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(temperature=0, max_tokens=8))
    assert not llm.engine.has_unfinished() and sorted(llm.engine.scheduler.free_slots) == [0, 1]


def with_word_tokenizer(folder, words):
    vocab = {w: i for i, w in enumerate(words)}
    Tokenizer(WordLevel(vocab, unk_token=words[0])).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": words[1], "eos_token": words[2]}))
    return folder


def test_draft_vocabularies_are_compared(tmp_path):
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]
    target = with_word_tokenizer(save_tiny(tmp_path / "t"), words)
    spec = {"method": "draft_model", "num_speculative_tokens": 2}
    # Without tokenizers only the sizes can be compared.
    bare = save_tiny(tmp_path / "bare")
    small = save_tiny(tmp_path / "small", vocab_size=64)
    with raises("draft vocabulary size 64 differs from the target's 96"):
        LLM(str(bare), speculative_config={**spec, "model": str(small)})
    # Another tokenizer drafts across vocabularies (cross_vocab.py): word-level ones by string level.
    other = with_word_tokenizer(save_tiny(tmp_path / "o", seed=6, num_hidden_layers=1),
                                words[:50] + ["zz"] + words[51:])
    assert LLM(str(target), speculative_config={**spec, "model": str(other)}).engine.k == 2
    swapped = with_word_tokenizer(save_tiny(tmp_path / "s"), words)
    (swapped / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "w0"}))
    with raises("special tokens differ: eos_id"):
        LLM(str(target), speculative_config={**spec, "model": str(swapped)})
    ok = with_word_tokenizer(save_tiny(tmp_path / "ok", seed=5, num_hidden_layers=1), words)
    assert LLM(str(target), speculative_config={**spec, "model": str(ok)}).engine.k == 2


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    cases = [
        (["generate", "hi", "--model", "/no/such/model"], "error: model path not found: /no/such/model"),
        (["generate", "hi", "--speculative-config", '{"method": "x"'], "error: speculative config: invalid JSON"),
        (["generate", "hi", "--temperature", "-1"], "error: invalid sampling parameter temperature=-1.0"),
    ]
    for argv, message in cases:
        r = subprocess.run([sys.executable, "-m", "speculant.cli", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip() == message or r.stderr.strip().startswith(message), r.stderr
        assert "Traceback" not in r.stderr


def test_speculation_shortcut_flags():
    from speculant.arguments import speculative_config_from_args
    from speculant.cli import build_parser

    def config(*flags):
        return speculative_config_from_args(build_parser().parse_args(["generate", "hi", *flags]))

    cfg = config("--eagle", "some/head", "-k", "3", "--lookup-first", "--adaptive")
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens, cfg.lookup_first, cfg.adaptive) == \
        ("eagle", "some/head", 3, True, True)
    cfg = config("--speculative-config", '{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}',
                 "--lookup-first")
    assert cfg.proposer == "draft_model+lookup"
    with raises("--lookup-first puts prompt lookup ahead of a model's drafts: give --draft-model"):
        config("--lookup-first")
    with raises("lookup_first .* needs method draft_model or eagle"):
        config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--lookup-first")
    assert config("--ngram", "--history-tokens", "5000").proposer == "ngram+history"
    cfg = config("--speculative-config", '{"method": "draft_model", "model": "d", "num_speculative_tokens": 2, '
                 '"lookup_first": true}', "--history-tokens", "5000")
    assert cfg.proposer == "draft_model+lookup+history" and cfg.history_tokens == 5000
    with raises("--history-tokens drafts from earlier answers beside prompt lookup: this run does not speculate"):
        config("--no-speculation", "--history-tokens", "5000")
    with raises("history_tokens .* needs method ngram or lookup_first"):
        config("--eagle", "some/head", "--history-tokens", "5000")
    with raises("history_tokens=-3 is out of range"):
        config("--ngram", "--history-tokens", "-3")


@pytest.mark.parametrize("argv, says", [
    (["serve", "--port", "99999"], "argument --port: expected 1 to 65535, got 99999"),
    (["serve", "--port", "-1"], "argument --port: expected 1 to 65535, got -1"),
    (["serve", "--threads", "-2"], "argument --threads: expected 1 or more, got -2"),
    (["generate", "hi", "--threads", "0"], "argument --threads: expected 1 or more, got 0"),
    (["advise", "--threads", "x"], "argument --threads: expected a whole number, got 'x'"),
    (["train-draft", "--kind", "eagle", "--threads", "0"], "argument --threads: expected 1 or more, got 0"),
])
def test_out_of_range_counts_are_refused_by_the_parser(argv, says, capsys):
    """The parser's one line, before anything loads: past it, a bad port ends in bind()'s OverflowError and a bad
    thread count in torch's RuntimeError."""
    from speculant.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
