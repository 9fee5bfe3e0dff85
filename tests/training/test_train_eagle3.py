"""`speculant train-draft --kind eagle3`: the training-time test computes what drafting computes, checkpoints
resume to the uninterrupted run's weights, and the head comes out in SpecForge's form, lossless in the engine."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny
from safetensors.torch import load_file, save_file
from test_eagle3 import peers_capture
from test_training import proposals, quick, repetitive_sequences

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.proposers.eagle3 import load_eagle3
from speculant.training import train as train_module
from speculant.training.data import load_dataset, record
from speculant.training.eagle3 import Eagle3Objective
from speculant.training.train import make_batch, train


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("train3") / "target", seed=0, num_hidden_layers=4, init_std=0.1)


@pytest.fixture(scope="module")
def data_dir(target_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data3")
    target = load_model(target_dir)
    data = record(repetitive_sequences(48, target.config.vocab_size), target, top_k=8)
    data["kinds"] = torch.zeros(48, dtype=torch.int32)
    save_file(data, str(folder / "shard-00000.safetensors"))
    return folder


def config(**overrides):
    return quick("eagle3", **{"epochs": 2, "max_minutes": 1e6, "draft_vocab": 24, "ttt_steps": 3, **overrides})


def test_training_time_test_computes_what_drafting_computes(target_dir):
    """Entry (t, j) of the training-time test equals the head's (j+1)-th draft after position t in a drafting
    pass through its KV cache, fed the true tokens: the mask and positions are drafting's."""
    target = load_model(target_dir, pack=False)
    objective = Eagle3Objective(target, config(), None)
    torch.manual_seed(1)
    for p in objective.model.parameters():
        p.data.normal_(0, 0.3) if p.dim() == 2 else p.data.uniform_(0.5, 1.5)
    head = objective.model
    tokens = torch.tensor([[1, 5, 9, 14, 20, 7, 3, 8]])
    T = tokens.shape[1] - 1
    features = objective.features(tokens)[:, :-1]
    embeds = target.model.embed(tokens).float()
    with torch.no_grad():
        hidden, keys, values, trained = head.fuse(features), [], [], []
        for j in range(3):
            shifted = torch.zeros_like(embeds[:, 1:])
            shifted[:, :T - j] = embeds[:, 1 + j:]
            out = objective.layer(shifted, hidden, keys, values, j)
            trained.append(out)
            hidden = out
        for t in range(T):
            cache = head.new_cache(1, T + 4)
            slots = torch.tensor([0])
            out = head(embeds[:, 1:t + 2], features[:, :t + 1], cache, slots)[:, -1:]
            torch.testing.assert_close(out[0, 0], trained[0][0, t], rtol=1e-3, atol=1e-3)
            for j in range(1, 3):
                if t + 1 + j > T:
                    break
                out = head(embeds[:, t + 1 + j:t + 2 + j], out, cache, slots)
                torch.testing.assert_close(out[0, 0], trained[j][0, t], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cache_gb", [4.0, 0.0])
def test_a_window_inside_a_sequence_reads_its_whole_sequence(target_dir, monkeypatch, cache_gb):
    """The head is fed the features drafting reads: the target's over everything before each position, as the
    recorded labels are; a window that starts mid-sequence read alone would lack its context."""
    target = load_model(target_dir, pack=False)
    seqs = [[(7 * i + 3) % 90 + 3 for i in range(n)] for n in (40, 30)]
    data = record(seqs, target, top_k=4)
    objective = Eagle3Objective(target, config(window=16, feature_cache_gb=cache_gb), None, data)
    fed = []
    layer = objective.layer
    monkeypatch.setattr(objective, "layer", lambda e, hidden, k, v, j: fed.append(hidden) or layer(e, hidden, k, v, j))
    objective.loss(make_batch(data, [(16, 16), (40 + 16, 14)]))
    with torch.no_grad():
        whole = [objective.features(torch.tensor([s]))[0] for s in seqs]
        expected = [objective.model.fuse(whole[0][16:31]), objective.model.fuse(whole[1][16:29])]
    torch.testing.assert_close(fed[0][0], expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fed[0][1, :13], expected[1], rtol=1e-4, atol=1e-4)


def test_checkpoint_and_resume_give_the_uninterrupted_weights(target_dir, data_dir, tmp_path, monkeypatch):
    target = load_model(target_dir, pack=False)
    data = load_dataset(data_dir)
    whole = train(target, data, config(checkpoint_every=3), tmp_path / "whole", progress_bar=False)
    assert whole["steps"] >= 7

    calls = {"n": 0}
    original = train_module.train_step

    def interrupted(*args):
        if calls["n"] == 5:
            raise KeyboardInterrupt
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(train_module, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(target, data, config(checkpoint_every=3), tmp_path / "resumed", progress_bar=False)
    monkeypatch.setattr(train_module, "train_step", original)
    assert json.loads((tmp_path / "resumed" / "checkpoint" / "state.json").read_text())["loop"]["step"] == 3
    resumed = train(target, data, config(checkpoint_every=3), tmp_path / "resumed", progress_bar=False)
    assert resumed["steps"] == whole["steps"]
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "resumed" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == sorted({row["step"] for row in log})


def test_trained_head_is_specforge_form_and_lossless(target_dir, data_dir, tmp_path):
    target = load_model(target_dir, pack=False)
    data = load_dataset(data_dir)
    summary = train(target, data, config(epochs=4), tmp_path, progress_bar=False)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"], (log[0], log[-1])
    assert summary["train_tokens_per_s"] > 0
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["architectures"] == ["LlamaForCausalLMEagle3"] and config_json["draft_vocab_size"] == 24
    # Trained on the inputs of layers (2, 2, 1): vLLM reads them so at the top level, SGLang as eagle_config's layer
    # outputs (1, 1, 0), capturing id + 1; and so does the loader here.
    assert config_json["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    assert config_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    assert peers_capture(config_json) == {"vllm": [2, 2, 1], "sglang": [2, 2, 1]}
    assert load_eagle3(tmp_path, target).aux_layers == (2, 2, 1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    ids = torch.arange(24) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], ids)
    counts = torch.bincount(data["topk_ids"][:, 0].long(), minlength=target.config.vocab_size)
    assert counts[ids].min() >= counts[~tensors["t2d"]].max()  # the most frequent first choices
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3})
    drafted = {t for step in proposals(spec, target) for t in step}
    assert drafted and drafted <= set(ids.tolist())
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [seq[:12] for seq in repetitive_sequences(2, target.config.vocab_size)]  # the training data's
    plain = Engine(target, max_batch_size=2, max_model_len=56)
    expected = [s.output_ids for s in plain.generate([plain.add_request(p, params) for p in prompts])]
    engine = Engine(target, build_proposer(spec, target, 2, 56 + 4), 3, max_batch_size=2, max_model_len=56)
    assert [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])] == expected
    assert engine.stats.num_accepted_tokens > 0
