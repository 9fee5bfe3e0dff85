"""The native Gated DeltaNet recurrence (csrc/gdn.cpp) against the recurrence written out in PyTorch: outputs and
every kept state, tiled and grouped heads, a head size the vectors do not divide; a row's bits do not depend on
its batch or on how its tokens are split into passes; a kept state paired with the wrong (row, position) is
caught on a hybrid model's speculation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speculant.models import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="the native kernels did not build on this machine")


TINY_QWEN35 = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, num_hidden_layers=4, init_std=0.1, tie_word_embeddings=False,
                   intermediate_size=96)
PROMPTS = [[5, 17, 33, 8, 60, 12], [40, 41, 42, 40, 41, 42, 40], [90, 3, 77, 21, 14, 9, 55, 31, 62, 90, 3, 77]]
SPECS = [{"method": "ngram", "num_speculative_tokens": 4},
         {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1}]


def reference(q, k, v, beta, g, state, tiled):
    """The recurrence token by token: S ← S·e^g; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq → out, states after each token."""
    B, T, Hk, dk = q.shape
    Hv = v.shape[2]
    heads = torch.arange(Hv) % Hk if tiled else torch.arange(Hv) // (Hv // Hk)
    q = F.normalize(q, dim=-1)[:, :, heads] * dk ** -0.5
    k = F.normalize(k, dim=-1)[:, :, heads]
    out, states = torch.empty_like(v), []
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhij,bhi->bhj", state, k[:, t]))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhij,bhi->bhj", state, q[:, t])
        states.append(state)
    return out, torch.stack(states, dim=1)  # [B, T, Hv, dk, dv]


def inputs(B, T, Hk, Hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return (r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv), torch.rand(B, T, Hv, generator=gen),
            -torch.rand(B, T, Hv, generator=gen), 0.1 * r(B, Hv, dk, dv))


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("dk,dv", [(128, 128), (16, 24)])
def test_native_recurrence_equals_pytorch(tiled, dk, dv):
    q, k, v, beta, g, state = inputs(3, 5, 2, 4, dk, dv)
    keep = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) < 0.5
    keep[:, -1] = True
    out, kept = native.gdn_recurrence(q, k, v, beta, g, state, keep, tiled)
    want_out, want_states = reference(q, k, v, beta, g, state, tiled)
    assert len(kept) == int(keep.sum())
    err_out = (out - want_out).abs().max().item()
    err_states = max((got - want_states[b, t]).abs().max().item() for (b, t), got in zip(keep.nonzero().tolist(), kept))
    print(f"dk {dk} dv {dv} tiled {tiled}: max |Δout| {err_out:.1e}, max |Δstate| {err_states:.1e}")
    assert err_out < 1e-5 and err_states < 1e-5


def test_a_rows_bits_do_not_depend_on_its_batch_or_its_passes():
    q, k, v, beta, g, state = inputs(3, 5, 2, 4, 128, 128, seed=2)
    every = torch.ones(3, 5, dtype=torch.bool)
    out, kept = native.gdn_recurrence(q, k, v, beta, g, state, every, True)
    row = [t[1:2].contiguous() for t in (q, k, v, beta, g, state)]
    alone, alone_kept = native.gdn_recurrence(*row, every[1:2], True)
    assert torch.equal(alone, out[1:2]) and all(torch.equal(a, b) for a, b in zip(alone_kept, kept[5:10]))
    # Two passes, 2 then 3 tokens, the second from the state the first kept.
    first = [t[:, :2].contiguous() for t in (q, k, v, beta, g)]
    second = [t[:, 2:].contiguous() for t in (q, k, v, beta, g)]
    out_a, kept_a = native.gdn_recurrence(*first, state, every[:, :2], True)
    mid = torch.stack([kept_a[2 * b + 1] for b in range(3)])
    out_b, _ = native.gdn_recurrence(*second, mid, every[:, 2:], True)
    assert torch.equal(torch.cat((out_a, out_b), dim=1), out)


def test_a_kept_state_paired_with_the_wrong_position_is_caught(tmp_path, monkeypatch):
    """Mutant: the kept states handed back in (position, row) order instead of (row, position), which is the
    same list for a batch of one, so only rows of a batch that keep several positions notice."""
    from conftest import greedy_tokens, save_tiny, transformers

    from speculant.models.loader import load_model

    target = load_model(save_tiny(tmp_path / "t", transformers.Qwen3_5TextConfig, seed=3, **TINY_QWEN35))
    plain = greedy_tokens(target, PROMPTS, n_tokens=24)
    real = native.gdn_recurrence

    def by_position(q, k, v, beta, g, state, keep, tiled):
        out, kept = real(q, k, v, beta, g, state, keep, tiled)
        order = sorted(range(len(kept)), key=lambda i: keep.nonzero()[i].flip(0).tolist())
        return out, [kept[i] for i in order]

    monkeypatch.setattr(native, "gdn_recurrence", by_position)
    runs = [greedy_tokens(target, PROMPTS, spec, max_batch_size=3, n_tokens=24) for spec in SPECS]
    assert any(run != plain for run in runs)
