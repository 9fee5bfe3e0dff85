"""The static passes CUDA graphs record (models/cuda_graphs.py): the same hidden states as the prepared
passes, and speculative output through them equal to plain output through them. On a CPU they run
uncaptured; the captured graphs need a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny
from test_eagle import saved_head
from test_greedy_lossless import PROMPTS, run
from test_tree import count_sibling_paths

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.llm import engine_for
from speculant.models.cuda_graphs import use_static_passes
from speculant.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def passes(model, cache_len: int = 64):
    """Two rows at lengths 7 and 12 after a prompt each, then a 4-token chain and a 4-token tree."""
    cache = model.new_cache(2, cache_len)
    slots = torch.tensor([0, 1])
    prompt = torch.arange(3, 15)[None].expand(2, -1)
    model(prompt, cache, slots, torch.tensor([7, 12]))
    chain = model(torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]]), cache, slots, torch.tensor([4, 2]))
    tree = model(torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]]), cache, slots,
                 parents=[[-1, 0, 0, 1], [-1, -1, 1, 2]])
    return chain, tree, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_pass_is_the_prepared_pass(tiny_pair, dtype):
    model = load_model(tiny_pair[0], dtype=dtype).model
    expected = passes(model)
    use_static_passes(model, replay=False)
    got = passes(model)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for e, g in zip(expected[:2], got[:2]):
        real = [(0, slice(0, 4)), (1, slice(0, 2))]  # row 1's chain has 2 real tokens, 2 padding
        for b, t in real:
            torch.testing.assert_close(g[b, t].float(), e[b, t].float(), atol=tol, rtol=tol)
    assert torch.equal(got[2].lengths, expected[2].lengths)
    torch.testing.assert_close(got[2].k[:, :, :, :14].float(), expected[2].k[:, :, :, :14].float(), atol=tol,
                               rtol=tol)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "num_speculative_tokens": 5}])
def test_speculation_through_static_passes_is_plain_greedy(tiny_pair, spec):
    target = load_model(tiny_pair[0])
    eager_plain = run(target, None, PROMPTS)[0]
    use_static_passes(target.model, replay=False)
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(tiny_pair[1])}
    plain = run(target, None, PROMPTS)[0]
    speculative, engine = run(target, spec, PROMPTS)
    assert speculative == plain
    assert plain == eager_plain
    assert engine.stats.num_accepted_tokens > 0


def test_draft_trees_through_static_passes_are_plain_greedy(tmp_path):
    """An EAGLE head's draft trees verified by static passes (tree masks built on the device), the kept
    sibling branches' keys moved: the output is plain greedy decoding's through the same passes. Weights
    large enough that attention decides tokens (a wrong tree mask changes the output: checked)."""
    target = load_model(save_tiny(tmp_path / "target", num_hidden_layers=3, init_std=0.2))
    use_static_passes(target.model, replay=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 5, 9, 14], [1, 33, 2, 7, 7, 7, 7, 40, 41], [1, 60]]
    engine = Engine(target, max_batch_size=3, max_model_len=64)
    plain = [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])]
    spec = SpeculativeConfig.parse({"method": "eagle", "model": str(saved_head(target, tmp_path / "head")),
                                    "num_speculative_tokens": 3, "tree_width": 4})
    engine = engine_for(target, spec, 3, 64)
    siblings = count_sibling_paths(engine)
    assert [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])] == plain
    assert siblings[0] > 0


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@CUDA
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_speculation_as_plain_greedy(tiny_pair, dtype):
    target = load_model(tiny_pair[0], dtype=dtype, device="cuda")
    assert target.model.narrow_passes == "graphs"
    plain = run(target, None, PROMPTS)[0]
    speculative, engine = run(target, {"method": "ngram", "num_speculative_tokens": 4}, PROMPTS)
    assert speculative == plain
    assert engine.model.graphs_for(engine.cache).graphs  # the passes were replayed from graphs
    use_static_passes(target.model, replay=False)  # --enforce-eager: the same kernels, launched one by one
    assert run(target, None, PROMPTS)[0] == plain


@CUDA
@torch.inference_mode()
def test_cuda_static_pass_scores_a_row_alike_alone_and_among_others(tiny_pair):
    """bf16 on CUDA: row 0 of 1- to 8-token passes, and of a batch of 3 rows, has the same bits."""
    model = load_model(tiny_pair[0], dtype="bfloat16", device="cuda").model
    cache = model.new_cache(3, 64)
    slots = torch.arange(3, device="cuda")
    model(torch.arange(3, 20, device="cuda")[None].expand(3, -1).contiguous(), cache, slots)
    tokens = torch.arange(30, 38, device="cuda")[None]
    rows = []
    for width, batch in [(1, 1), *((t, 1) for t in range(2, 9)), (1, 3), (5, 3)]:
        cache.lengths[:] = 17
        rows.append(model(tokens[:, :width].expand(batch, -1).contiguous(), cache, slots[:batch])[0, 0])
    for row in rows[1:]:
        assert torch.equal(row, rows[0])
