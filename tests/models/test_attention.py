"""The native attention kernels (csrc/attention.cpp, the vector one, bf16 and fp32; csrc/attention_amx.cpp, the
AMX one, bf16): close to an fp32 reference, and each row's bits independent of the call it is in: a verify pass row
equals the row alone, a draft tree's node equals its branch laid out and decoded alone. These are the
properties bf16 speculation's exactness rests on (test_models, test_tree check them end to end)."""

import pytest
import torch

from speculant.models import native

pytestmark = pytest.mark.skipif(not native.attention_usable(64),
                                reason="the native attention kernel does not run here (no AVX2, or no compiler)")

KERNELS = [pytest.param(False, id="vector"),
           pytest.param(True, id="amx", marks=pytest.mark.skipif(not native.amx(), reason="this CPU has no AMX")),
           pytest.param("fp32", id="vector-fp32")]
TOLERANCE = {False: 0.02, True: 0.02, "fp32": 1e-4}  # bf16 output of values ~N(0, 1): a few bf16 steps


def attend(q, keys, values, n_keys, tree=None, amx=True):
    """amx "fp32": the vector kernel on fp32 copies of the bf16 inputs."""
    if amx == "fp32":
        q, keys, values = q.float(), keys.float(), values.float()
    return native.kernels().attention(q, keys, values, n_keys, q.shape[-1] ** -0.5, None, tree, amx is True)


def reference(q, keys, values, n_keys, tree=None):
    """fp32 softmax attention over each row's keys: the first n_keys, or in a tree the cached keys and
    the row's ancestors among the pass's new tokens."""
    B, T, H, D = q.shape
    group = H // keys.shape[1]
    out = torch.zeros(B, T, H, D)
    for b in range(B):
        for t in range(T):
            n = int(n_keys[b, t])
            seen = list(range(n))
            if tree is not None:
                start = n - 1 - t
                seen = list(range(start)) + [start + j for j in range(t + 1) if int(tree[b, t]) >> j & 1]
            for h in range(H):
                k, v = keys[b, h // group, seen].float(), values[b, h // group, seen].float()
                out[b, t, h] = torch.softmax(k @ q[b, t, h].float() * D ** -0.5, 0) @ v
    return out


def random_call(gen, B, T, H, Hkv, D, first, S):
    q = torch.randn(B, T, H, D, generator=gen).bfloat16()
    keys, values = (torch.randn(B, Hkv, S, D, generator=gen).bfloat16() for _ in range(2))
    return q, keys, values, (torch.arange(T) + first + 1).repeat(B, 1)


# (B, T, Hq, Hkv, D, keys before the pass, cache length): SmolLM2's heads; a key count on a tile edge, the
# cache ending inside a key block; 24 rows (two row blocks); head size 128; a row block mixing positions; a
# prompt chunk of 40 tokens × 6 heads a key head (tasks of several tokens, ragged key counts).
SHAPES = [(1, 1, 9, 3, 64, 300, 400), (1, 8, 9, 3, 64, 31, 64), (2, 5, 9, 3, 64, 37, 45),
          (1, 6, 4, 2, 128, 100, 120), (1, 7, 32, 8, 64, 15, 40), (2, 40, 12, 2, 128, 500, 560)]


@pytest.mark.parametrize("amx", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_is_close_to_fp32_and_a_row_scores_as_alone(shape, amx):
    B, T, H, Hkv, D, first, S = shape
    q, keys, values, n_keys = random_call(torch.Generator().manual_seed(sum(shape)), *shape)
    out = attend(q, keys, values, n_keys, amx=amx)
    assert (out.float() - reference(q, keys, values, n_keys)).abs().max() < TOLERANCE[amx]
    for t in range(T):
        alone = attend(q[:, t:t + 1], keys, values, n_keys[:, t:t + 1], amx=amx)
        assert torch.equal(alone[:, 0], out[:, t]), f"row {t}"


@pytest.mark.parametrize("amx", KERNELS)
@pytest.mark.parametrize("first", [20, 31, 32, 33, 95])
def test_a_tree_node_attends_as_its_branch_decoded_alone(first, amx):
    """Nodes 0..6 of a tree (parents below) after `first` cached keys: each node's output equals the
    output of its branch's last token when the branch's keys sit at consecutive positions, alone."""
    parents = [-1, 0, 0, 1, 1, 2, 4]
    bits = []
    for t, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | 1 << t)
    T = len(parents)
    q, keys, values, n_keys = random_call(torch.Generator().manual_seed(first), 1, T, 9, 3, 64, first, first + 16)
    tree = torch.tensor([bits])
    out = attend(q, keys, values, n_keys, tree, amx=amx)
    assert (out.float() - reference(q, keys, values, n_keys, tree)).abs().max() < TOLERANCE[amx]
    for t in range(T):
        branch = [t]
        while parents[branch[-1]] >= 0:
            branch.append(parents[branch[-1]])
        branch.reverse()
        k, v = keys.clone(), values.clone()
        for depth, node in enumerate(branch):
            k[:, :, first + depth], v[:, :, first + depth] = keys[:, :, first + node], values[:, :, first + node]
        alone = attend(q[:, t:t + 1], k, v, torch.tensor([[first + len(branch)]]), amx=amx)
        assert torch.equal(alone[:, 0], out[:, t]), f"node {t}"


def test_a_kernel_lets_other_threads_run_while_it_works():
    """The server streams a step's tokens from its HTTP thread while the engine thread is in the next pass: a
    kernel that kept the GIL would hold every stream back by a whole pass. The main thread here must get to run
    while another thread is inside one kernel call (with the GIL kept, not one of its loop turns could)."""
    import threading
    import time

    torch.manual_seed(0)
    keys = torch.randn(1, 2, 4096, 128).to(torch.bfloat16)
    q = torch.randn(1, 256, 12, 128).to(torch.bfloat16)
    n_keys = torch.full((1, 256), 4000)
    inside: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        attend(q, keys, keys, n_keys, amx=False)
        inside.extend((t0, time.perf_counter()))

    def spin(until) -> list[float]:
        seen = []
        while until():
            seen.append(time.perf_counter())
        return seen

    # The main thread's pace alone, then beside the call: with the GIL kept it ran at ~0.2 % of it, released
    # at ~40 % (2 cores, the kernel on both).
    t_stop = time.perf_counter() + 0.05
    alone = len(spin(lambda: time.perf_counter() < t_stop)) / 0.05
    worker = threading.Thread(target=work)
    worker.start()
    seen = spin(worker.is_alive)
    worker.join()
    start, end = inside
    assert end - start > 0.02, "the call must last long enough to tell"
    during = [t for t in seen if start + 0.005 < t < end - 0.005]
    assert len(during) > 0.05 * alone * (end - start - 0.01), (
        f"the main thread ran {len(during)} times in a {end - start:.3f} s kernel call, {alone:.0f} a second alone")
