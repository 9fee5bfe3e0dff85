"""Sampling transforms give the right support; seeded sampling reproduces whatever the batch."""

from __future__ import annotations

import pytest
import torch

from speculant import sampling
from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models import native
from speculant.models.loader import load_model
from speculant.sampling import SamplingBatch, argmax, probabilities
from speculant.verify import follow_chain, verify

LOGITS = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]])  # softmax ≈ .63 .23 .09 .03 .01 .00


def probs(**kw) -> torch.Tensor:
    params = SamplingParams(**kw)
    return probabilities(LOGITS, SamplingBatch.build([params], [None], torch.device("cpu")))[0, 0]


def support(p: torch.Tensor) -> list[int]:
    return torch.nonzero(p).flatten().tolist()


def test_top_k_keeps_k_most_likely():
    assert support(probs(top_k=2)) == [0, 1]
    assert support(probs(top_k=-1)) == [0, 1, 2, 3, 4, 5]


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(LOGITS[0, 0], -1)
    assert support(probs(top_p=0.5)) == [0]  # 0.63 ≥ 0.5 alone
    assert support(probs(top_p=float(full[0] + 0.01))) == [0, 1]
    assert support(probs(top_p=float(full[:3].sum()))) == [0, 1, 2]


@pytest.mark.parametrize("scale, sorts", [(0.3, True), (3.0, False), (6.0, False)])
def test_top_k_top_p_from_candidates_is_the_sorted_vocabulary(scale, sorts, monkeypatch):
    """The kept tokens and their logits are those read from the whole sorted vocabulary, whether the
    likeliest candidates hold the nucleus (peaked rows) or not (flat rows: then it sorts)."""
    torch.manual_seed(0)
    V = 4096
    logits = torch.randn(5, 3, V) * scale
    top_k = torch.tensor([0, 40, 1000, 1000, 0])
    top_p = torch.tensor([0.9, 0.5, 0.99, 1.0, 1.0])  # the last row keeps everything, and needs no sort
    filtered = sampling._top_k_top_p
    read = []
    monkeypatch.setattr(sampling, "_top_k_top_p", lambda *a: read.append(a[3] if len(a) > 3 else None) or filtered(*a))
    got = sampling._top_k_top_p(logits, top_k, top_p)
    assert (V in read) == sorts
    want = filtered(logits, top_k, top_p, V)
    kept = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), kept)
    assert torch.equal(got[kept], want[kept])
    assert kept[3].sum(-1).tolist() == [1000] * 3  # top_p = 1 drops nothing past top-k
    assert kept[4].all()


def test_min_p_drops_tokens_below_fraction_of_max():
    full = torch.softmax(LOGITS[0, 0], -1)
    ratio = full / full[0]  # 1, .37, .14, .05, .02, .007
    assert support(probs(min_p=float(ratio[2]) - 1e-3)) == [0, 1, 2]
    assert support(probs(min_p=0.5)) == [0]


def test_transforms_renormalize_and_temperature_sharpens():
    p = probs(top_k=3, temperature=0.5)
    assert p.sum().item() == pytest.approx(1.0, abs=1e-6)
    expected = torch.softmax(LOGITS[0, 0, :3] / 0.5, -1)
    assert torch.allclose(p[:3], expected, atol=1e-6)


def test_greedy_is_one_hot_argmax():
    assert probs(temperature=0).tolist() == [1.0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("kernel", ["native", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 77])
def test_argmax_is_the_first_maximum_like_torch(vocab, dtype, kernel, monkeypatch):
    if kernel == "native" and not native.argmax_usable(torch.zeros(1, dtype=dtype)):
        pytest.skip("the native kernels do not run here")
    if kernel == "chunked":
        monkeypatch.setattr(native, "argmax_usable", lambda x: False)
    gen = torch.Generator().manual_seed(0)
    # Coarse values make ties common, inside a 128-wide chunk and across chunks.
    logits = torch.randint(0, 40, (6, 9, vocab), generator=gen).to(dtype)
    logits[0, 0, [5, 30, 70]] = 99.0
    logits[1, 0] = float("-inf")
    logits[1, 1, [9, 40]] = float("nan")  # torch.argmax: the first NaN
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(logits)[0, 0] == 5
    strided = torch.randn(4, 2 * vocab, generator=gen).to(dtype)[:, ::2]
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))


def test_greedy_verification_is_the_rule_with_one_hot_distributions():
    """follow_chain against the target's argmax tokens (greedy verification) must equal the acceptance
    rule fed one-hot p and q: on random drafts (often agreeing with the target, so every accepted length
    from 0 to n_draft occurs) both give the same result."""
    gen = torch.Generator().manual_seed(1)
    B, k, V = 64, 5, 7
    target = torch.randint(0, V, (B, k + 1), generator=gen)
    other = torch.randint(0, V, (B, k), generator=gen)
    draft = torch.where(torch.rand(B, k, generator=gen) < 0.8, target[:, :k], other)
    n_draft = torch.randint(0, k + 1, (B,), generator=gen)
    one_hot = torch.nn.functional.one_hot(target, V).float()
    rows = [follow_chain(d[:n], lambda column, offset, t=t: t[column])
            for d, n, t in zip(draft.tolist(), n_draft.tolist(), target.tolist())]
    n_acc, nxt = [n for n, _ in rows], [token for _, token in rows]
    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * B, [None] * B, torch.device("cpu"))
    drafts_q = torch.nn.functional.one_hot(draft, V).float()  # deterministic drafts: q one-hot
    ref_acc, ref_next = verify(draft, n_draft, one_hot, drafts_q, greedy)
    assert n_acc == ref_acc.tolist() and nxt == ref_next.tolist()
    assert set(n_acc) == set(range(k + 1))


def test_mixed_rows_get_their_own_transforms():
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0), SamplingParams(min_p=0.2)]
    sb = SamplingBatch.build(params, [None] * 3, torch.device("cpu"))
    p = probabilities(LOGITS.expand(3, 1, 6), sb)[:, 0]
    assert [support(r) for r in p] == [[0], [0], [0, 1]]


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


def sample_outputs(target, params_list, max_batch_size=4):
    engine = Engine(target, max_batch_size=max_batch_size, max_model_len=64)
    seqs = [engine.add_request([3, 4, 5], p) for p in params_list]
    engine.generate(seqs)
    return [s.output_ids for s in seqs]


def test_seeded_sampling_reproduces_across_batches(target):
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    alone = sample_outputs(target, [p])[0]
    again = sample_outputs(target, [p])[0]
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2, 3)]
    in_batch = sample_outputs(target, [others[0], p, others[1], others[2]])[1]
    assert alone == again == in_batch
    different_seeds = sample_outputs(target, others)
    assert len({tuple(o) for o in different_seeds + [alone]}) > 1


def test_generated_tokens_stay_in_the_top_k_support(target):
    params = SamplingParams(temperature=1.5, top_k=3, seed=7, max_tokens=10, ignore_eos=True)
    engine = Engine(target, max_batch_size=1, max_model_len=64)
    seq = engine.add_request([3, 4, 5], params)
    engine.generate([seq])
    model = target.model
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        logits = model.logits(model(torch.tensor([seq.tokens[:-1]]), cache, torch.tensor([0])))[0]
    for i, tok in enumerate(seq.output_ids):
        top3 = logits[2 + i].topk(3).indices.tolist()  # position 2 is the last prompt token
        assert tok in top3


def test_sample_draws_each_token_with_its_probability_and_never_a_zero_one():
    """Unnormalized rows (the verifier's residual p − q) included: 40 000 draws, chi-square at 0.001."""
    from scipy.stats import chisquare

    from speculant.sampling import TOKEN, request_key, sample, uniform

    weights = torch.tensor([0.0, 0.05, 0.0, 0.6, 0.3, 0.0, 0.001, 0.049]) * 2.5
    key = request_key(0)
    counts = torch.zeros(len(weights))
    for position in range(40_000):
        counts[sample(weights[None], [uniform(key, position, TOKEN)])[0]] += 1
    support = weights > 0
    assert counts[~support].sum() == 0
    expected = (weights[support] / weights.sum() * counts.sum()).numpy()
    assert chisquare(counts[support].numpy(), expected).pvalue > 0.001


NATIVE_TRANSFORMS = [(0.7, 0, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.15),
                     (0.7, 20, 0.9, 0.05), (1.0, 0, 0.999, 0.0)]


# bf16 rows hold ties (8 bits of mantissa), and which of two equal tokens top-k or top-p keeps is not
# defined: bf16 under temperature alone, where order does not matter.
@pytest.mark.parametrize("transforms, dtype", [(t, torch.float32) for t in NATIVE_TRANSFORMS]
                         + [(NATIVE_TRANSFORMS[0], torch.bfloat16)])
def test_native_sampler_splits_the_unit_interval_by_probability(transforms, dtype):
    """sampling.cpp's inverse CDF: N draws at u = (i + ½)/N land on token j about p_j · N times (within
    one draw each, and a few ulps), p what sampling.probabilities gives under the transforms; a row of
    700 tokens crosses the kernel's blocks of 256."""
    if not native.sampling_usable(torch.zeros(1, dtype=dtype)):
        pytest.skip("the native sampler does not run here (no AVX2, or no compiler)")
    temperature, top_k, top_p, min_p = transforms
    gen = torch.Generator().manual_seed(0)
    row = (torch.randn(700, generator=gen) * 3).to(dtype)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    p = probabilities(row[None, None], SamplingBatch.build([params], [None], torch.device("cpu")))[0, 0].double()
    assert 1 < int((p > 0).sum()) < 700 or not (top_k or top_p < 1 or min_p)  # the transforms cut
    N = 50_000
    counts = torch.bincount(torch.tensor([native.sample_row(row, transforms, (i + 0.5) / N) for i in range(N)]),
                            minlength=700)
    assert (counts.double() - p * N).abs().max() <= 1.05
