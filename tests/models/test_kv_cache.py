"""The KV cache costs memory only where rows are written: sized for every row at the whole context, it takes
about nothing at load, a sequence's positions as they are written, and gives a freed row's pages back."""

from __future__ import annotations

import torch
from conftest import save_tiny

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models.kv_cache import KVCache
from speculant.models.loader import load_model

MIB = 2 ** 20


def resident() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_memory_follows_what_rows_hold():
    before = resident()
    cache = KVCache(n_layers=4, max_batch=8, n_kv_heads=2, max_len=16384, head_dim=64, dtype=torch.bfloat16,
                    device="cpu")
    assert resident() - before < 8 * MIB, "the cache wrote its pages at load"  # it spans 256 MiB

    n = 4000
    keys = torch.randn(4, 2, n, 64).to(torch.bfloat16)
    written = 2 * keys.numel() * keys.element_size()  # 8 MiB, keys and values
    before = resident()
    cache.write_row(3, keys, keys)
    grew = resident() - before
    assert written <= grew < written + 4 * MIB, (grew, written)

    before = resident()
    cache.release(3)
    assert before - resident() > written - 2 * MIB, "a released row kept its pages"
    # Reading unwritten or released positions takes no pages and gives zeros. Whole pages go back: those at
    # each end of a layer's row are shared with its neighbours.
    assert not cache.k[:, 5].any() and not cache.v[:, 5].any()
    assert not cache.k[:, 3, :, 128:n - 128].any() and not cache.v[:, 3, :, 128:n - 128].any()


def test_a_finished_request_gives_its_row_back(tmp_path):
    """After generate, the row a request held reads as zeros (its pages returned), and a sequence on that row
    again writes the same answer."""
    model = load_model(save_tiny(tmp_path / "tiny", seed=3), dtype="float32")
    engine = Engine(model, max_batch_size=2, max_model_len=500)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = [3 + i % 90 for i in range(400)]
    first = engine.generate([engine.add_request(prompt, params)])[0]
    assert not engine.cache.k[:, first.slot, :, 128:400].any()
    again = engine.generate([engine.add_request(prompt, params)])[0]
    assert again.slot == first.slot and again.output_ids == first.output_ids
