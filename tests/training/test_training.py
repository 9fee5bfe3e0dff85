"""`speculant train-draft` on tiny models: data recording, both kinds of draft, reload."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_tiny
from safetensors.torch import save_file

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.proposers.eagle import load_eagle
from speculant.sampling import SamplingBatch
from speculant.training.data import (
    build_dataset,
    build_items,
    describe,
    in_shards,
    load_dataset,
    record,
    rewrite_items,
    written_answers,
)
from speculant.training.prompts import answer_paragraph
from speculant.training.train import TrainConfig, split_windows, top_k_kl, train


def repetitive_sequences(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Sequences with structure a draft can learn quickly: short cycles of tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        cycle = torch.randint(3, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        out.append((cycle * 40)[:int(torch.randint(40, 90, (1,), generator=g))])
    return out


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("train") / "target", seed=0, num_hidden_layers=2, init_std=0.1)


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    target = load_model(tiny_target)
    data = record(repetitive_sequences(48, target.config.vocab_size), target, top_k=8)
    data["kinds"] = torch.zeros(48, dtype=torch.int32)
    save_file(data, str(folder / "shard-00000.safetensors"))
    return folder


def quick(kind: str, **overrides) -> TrainConfig:
    base = dict(kind=kind, epochs=4, batch_size=8, window=64, lr=3e-3, warmup_steps=3, log_every=2,
                eval_every=4, draft_dim=32, draft_layers=1, draft_heads=2, draft_kv_heads=1,
                draft_intermediate=64)
    base.update(overrides)
    return TrainConfig(**base)


def test_record_matches_the_target(tiny_target):
    target = load_model(tiny_target)
    seqs = [[1, 5, 7, 9], [1, 4, 4]]
    data = record(seqs, target, top_k=4)
    assert data["tokens"].tolist() == [1, 5, 7, 9, 1, 4, 4]
    assert data["offsets"].tolist() == [0, 4, 7]
    cache = target.model.new_cache(1, 4)
    hidden = target.model(torch.tensor([seqs[0]]), cache, torch.tensor([0]))[0]
    top = torch.log_softmax(target.model.logits(hidden), -1).topk(4)
    assert torch.equal(data["topk_ids"][:4], top.indices.int())
    torch.testing.assert_close(data["hidden"][:4].float(), hidden, atol=2e-2, rtol=2e-2)


def test_windows_never_mix_train_and_validation():
    offsets = torch.tensor([0, 100, 150, 400, 410])
    train_w, val_w = split_windows(offsets, 64, 0.25, seed=0)
    covered = sorted(train_w + val_w)
    assert sum(n for _, n in covered) == 410
    assert all(n <= 64 for _, n in covered)
    seq_of = lambda start: int(torch.searchsorted(offsets, start, right=True)) - 1  # noqa: E731
    assert not {seq_of(s) for s, _ in train_w} & {seq_of(s) for s, _ in val_w}


@pytest.mark.parametrize("kind", ["eagle", "draft_model"])
def test_training_lowers_the_loss_and_reloads(kind, tiny_target, tiny_data, tmp_path):
    target = load_model(tiny_target, pack=False)
    summary = train(target, load_dataset(tiny_data), quick(kind), tmp_path / kind, progress_bar=False)
    log = [json.loads(line) for line in (tmp_path / kind / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"], (log[0], log[-1])
    assert (tmp_path / kind / "loss.png").stat().st_size > 1000
    first_val = next(row["val_loss"] for row in log if "val_loss" in row)
    assert summary["val_loss"] < first_val
    # Reload through the engine's own path and draft the same tokens twice.
    spec = SpeculativeConfig.parse({"method": kind, "model": str(tmp_path / kind),
                                    "num_speculative_tokens": 4})
    assert proposals(spec, target) == proposals(spec, target)


def proposals(spec: SpeculativeConfig, target) -> list[list[int]]:
    """Greedy drafts at every step of a short generation with a freshly loaded proposer."""
    proposer = build_proposer(spec, target, 1, 64)
    engine = Engine(target, proposer, spec.num_speculative_tokens, max_batch_size=1, max_model_len=48)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seq = engine.add_request([1, 7, 9, 7, 9, 7], params)
    seen = []
    original = proposer.propose

    def spy(seqs, ks, sb: SamplingBatch):
        out = original(seqs, ks, sb)
        seen.append(out.tokens[0, :int(out.n_draft[0])].tolist())
        return out

    proposer.propose = spy
    engine.generate([seq])
    return seen


def test_eagle_with_a_draft_vocabulary(tiny_target, tiny_data, tmp_path):
    """--draft-vocab N: the head keeps the N tokens the target most often ranks first, trains its
    KL over them, and drafts only them after reloading."""
    target = load_model(tiny_target, pack=False)
    data = load_dataset(tiny_data)
    summary = train(target, data, quick("eagle", draft_vocab=16), tmp_path, progress_bar=False)
    assert 0 <= summary["val_top1_1"] <= 1
    counts = torch.bincount(data["topk_ids"][:, 0].long(), minlength=target.config.vocab_size)
    head = load_eagle(tmp_path, target)
    assert len(head.vocab) == 16 and head.vocab.tolist() == sorted(head.vocab.tolist())
    assert counts[head.vocab].min() >= counts[~torch.isin(torch.arange(len(counts)), head.vocab)].max()
    spec = SpeculativeConfig.parse({"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 4})
    drafted = {t for step in proposals(spec, target) for t in step}
    assert drafted and drafted <= set(head.vocab.tolist())


def test_distilled_draft_loads_in_transformers(tiny_target, tiny_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    target = load_model(tiny_target, pack=False)
    train(target, load_dataset(tiny_data), quick("draft_model", epochs=1), tmp_path, progress_bar=False)
    ours = load_model(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 12, 5, 9]])
    cache = ours.model.new_cache(1, 6)
    mine = ours.model.logits(ours.model(ids, cache, torch.tensor([0])))
    torch.testing.assert_close(mine, ref(ids).logits.float(), atol=1e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def tiny_with_smollm_tokenizer(smollm_path, tmp_path_factory):
    """A tiny random model that uses SmolLM2's tokenizer (and chat template)."""
    from speculant.models.gguf import convert_gguf

    folder = save_tiny(tmp_path_factory.mktemp("tok") / "tiny", vocab_size=49152, hidden_size=32,
                       intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(convert_gguf(smollm_path)[0] / name, folder / name)
    return load_model(folder)


def test_dataset_from_the_standard_library(tiny_with_smollm_tokenizer, tmp_path):
    """The full recording path (pools, chat template, self-written answers, resume, manifest)."""
    target = tiny_with_smollm_tokenizer
    settings = dict(n_text_chars=6000, n_prompts=12, answer_tokens=48, top_k=4, max_len=64, shard_items=4)
    # Two workers one after the other: the first leaves the data set incomplete, the second finds the
    # first phase complete and records the rest.
    assert not build_dataset(target, tmp_path / "data", **settings, worker=0, workers=2)["complete"]
    manifest = build_dataset(target, tmp_path / "data", **settings, worker=1, workers=2)
    assert manifest["complete"]
    assert not list((tmp_path / "data").glob("*.tmp*"))
    assert set(manifest["make_up"]) >= {"code", "prose", "chat:code", "chat:question", "chat:writing"}
    first_phase = in_shards(build_items(6000, 12, 0), 4)
    writing = [it for shard in first_phase for it in shard if it.kind == "chat:writing"]
    answers = written_answers(tmp_path / "data", first_phase, target, 64)
    assert len(answers) == manifest["make_up"]["chat:writing"]["sequences"] == len(writing)
    # Each is the answer alone, without its request; the second phase rewrote every usable one.
    assert all(a and it.text not in a for it, a in zip(writing, answers))
    rewrites = rewrite_items(answers, seed=1)  # build_dataset draws them with its seed (0) + 1
    assert rewrites and manifest["make_up"]["chat:rewrite"]["sequences"] == len(rewrites)
    assert manifest["tokens"] == len(load_dataset(tmp_path / "data")["tokens"])
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["tokens"] == manifest["tokens"]
    # Resuming records nothing again: the shards are kept as they are.
    shards = sorted((tmp_path / "data").glob("shard-*"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    build_dataset(target, tmp_path / "data", **settings)
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    assert describe(tmp_path / "data", target, manifest["settings"])["tokens"] == manifest["tokens"]


STORY = ("Maria woke up early because she had an interview. She put on her blue jacket, checked her notes "
         "twice and walked to the station. The train was late, so she called the office to explain.")


def test_rewrites_take_the_longest_prose_paragraph_of_an_answer():
    answer = f"Sure! Here is a story.\n\n{STORY}\n\n- a list item that is not prose, " + "x " * 100
    assert answer_paragraph(answer) == STORY
    assert answer_paragraph("Too short.\n\n- list " + "y " * 100) is None
    long = " ".join([STORY] * 8)
    cut = answer_paragraph(long, max_chars=400)
    assert cut.endswith(".") and len(cut) <= 400 and long.startswith(cut)


def test_rewrite_items_one_per_usable_answer():
    items = rewrite_items([STORY, "No.", "```python\nprint(1)\n```", STORY], seed=0)
    assert len(items) == 2 and all(it.kind == "chat:rewrite" for it in items)
    for it in items:
        instruction, body = it.text.split("\n\n", 1)
        assert instruction.endswith(":") and len(body.split()) == len(STORY.split())
    assert rewrite_items([STORY] * 30, seed=1) == rewrite_items([STORY] * 30, seed=1)
    assert len({it.text for it in rewrite_items([STORY] * 30, seed=1)}) > 5


def test_data_from_several_folders(tiny_target, tiny_data, tmp_path):
    target = load_model(tiny_target)
    more = tmp_path / "more"
    more.mkdir()
    extra = record(repetitive_sequences(3, target.config.vocab_size, seed=1), target, top_k=8)
    extra["kinds"] = torch.zeros(3, dtype=torch.int32)
    save_file(extra, str(more / "shard-00000.safetensors"))
    one, both = load_dataset(tiny_data), load_dataset([tiny_data, more])
    n = len(one["tokens"])
    assert torch.equal(both["tokens"], torch.cat([one["tokens"], extra["tokens"]]))
    assert torch.equal(both["offsets"], torch.cat([one["offsets"], extra["offsets"][1:] + n]))
    assert torch.equal(both["hidden"][n:], extra["hidden"])
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    save_file(record([[1, 2, 3]], target, top_k=4), str(narrow / "shard-00000.safetensors"))
    with pytest.raises(SpeculantError, match="different targets or with different --top-k"):
        load_dataset([tiny_data, narrow])
    with pytest.raises(SpeculantError, match="no recorded shards"):
        load_dataset([tiny_data, tmp_path / "missing"])


def test_kl_of_a_row_outside_the_draft_vocabulary_is_zero_with_finite_gradients():
    """With a small draft vocabulary some positions have none of the target's top-k inside it: they
    must count 0 and leave the gradients finite (an all -inf row made the whole head NaN)."""
    logits = torch.randn(3, 10, requires_grad=True)
    logprobs = torch.log_softmax(torch.randn(3, 4), -1)
    ids = torch.tensor([[1, 2, -1, 3], [-1, -1, -1, -1], [0, -1, -1, -1]])
    top_k_kl(logits, logprobs, ids).backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[1], torch.zeros(10))
    rows_with_tokens = top_k_kl(logits[[0, 2]], logprobs[[0, 2]], ids[[0, 2]])
    torch.testing.assert_close(top_k_kl(logits, logprobs, ids), rows_with_tokens * 2 / 3)


def test_corpus_table_from_recorded_data(tiny_target, tiny_data, tmp_path):
    """`train-draft --kind corpus` reads the recorded tokens only and writes a table that drafts the
    cycles the sequences repeat."""
    import time

    from speculant.proposers.corpus import load_corpus
    from speculant.training.cli import build_corpus
    from speculant.training.data import load_token_sequences

    data = load_dataset(tiny_data)
    offsets = data["offsets"].tolist()
    sequences = list(load_token_sequences([tiny_data]))
    assert sequences == [data["tokens"][a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    target = load_model(tiny_target)
    assert build_corpus(target, [tiny_data], tmp_path / "corpus", time.perf_counter()) == 0
    summary = json.loads((tmp_path / "corpus" / "summary.json").read_text())
    assert summary["tokens"] == len(data["tokens"]) and summary["entries"] > 0
    table = load_corpus(tmp_path / "corpus", target)
    cycle = sequences[0][:8]
    drafts, context = table.draft(cycle, 4)
    assert context == 3 and drafts == sequences[0][8:12]


def test_greedy_answers_for_a_corpus_table(tiny_with_smollm_tokenizer, tmp_path):
    """record_answers: the requests, then rewrites of the target's writing, answered greedily in batches,
    tokens only; a rerun keeps the shards."""
    from speculant.engine import Engine
    from speculant.training.data import load_token_sequences, record_answers

    target = tiny_with_smollm_tokenizer
    manifest = record_answers(target, tmp_path / "answers", n_prompts=12, answer_tokens=48, seed=0, batch_size=5,
                              shard_items=4)
    sequences = list(load_token_sequences([tmp_path / "answers"]))
    items = build_items(0, 12, 0)
    assert manifest["complete"] and manifest["tokens"] == sum(map(len, sequences))
    assert len(sequences) == manifest["sequences"] > len(items)  # the rewrites came after the requests
    first = [target.tokenizer.encode_chat([{"role": "user", "content": it.text}]) for it in items[:2]]
    engine = Engine(target, max_batch_size=1, max_model_len=max(map(len, first)) + 49)
    for prompt, recorded in zip(first, sequences):
        seq = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=48))
        engine.generate([seq])
        assert recorded == seq.tokens  # the prompt, then the greedy answer decoded alone
    shards = sorted((tmp_path / "answers").glob("shard-*"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    assert record_answers(target, tmp_path / "answers", n_prompts=12, answer_tokens=48, seed=0, batch_size=5,
                          shard_items=4)["tokens"] == manifest["tokens"]
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    with pytest.raises(SpeculantError, match="holds tokens only"):
        load_dataset(tmp_path / "answers")


def test_train_draft_corpus_records_greedy_answers_then_builds_the_table(tiny_with_smollm_tokenizer, tmp_path):
    from speculant.cli import main
    from speculant.proposers.corpus import load_corpus

    target = tiny_with_smollm_tokenizer
    out = tmp_path / "corpus"
    assert main(["train-draft", "--kind", "corpus", "--target", str(target.source), "--out", str(out),
                 "--prompts", "6", "--answer-tokens", "24", "--dtype", "float32"]) == 0
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert manifest["recorded"] == ["tokens (greedy answers)"] and summary["tokens"] == manifest["tokens"]
    assert load_corpus(out, target).entries == summary["entries"]
