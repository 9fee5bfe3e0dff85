"""The acceptance rule, tested alone with the power to see small errors.

The engine-level G-tests (test_distribution.py) see a model's whole output and catch gross errors; here
verify() runs on N_ROWS independent rows of one fixed pair of target and draft distributions (vocabulary 8,
two draft positions, each draft drawn from its q), where every outcome's probability is known exactly:
- the acceptance rate at each position against Σ min(p, q), a binomial z-test;
- the first output token against p₁, and the second, where the first draft was kept, against p₂: G-tests.
Each test is at significance ALPHA; mutants of the rule off by 5% (and, in the slow suite, less) must fail.
The request transforms that make p and q are checked against an independent NumPy implementation.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from mutants import patch_rule_error
from scipy.stats import norm, power_divergence

from speculant.config import SamplingParams
from speculant.sampling import SamplingBatch, probabilities, request_key
from speculant.verify import verify

ALPHA = 1e-3
N_ROWS = 200_000
V = 8
# Fixed distributions with partial overlap: a draft right about half the time, a residual unlike p.
RNG = np.random.default_rng(7)
P = torch.tensor(RNG.dirichlet(np.full(V, 0.6), 3), dtype=torch.float32)  # positions 1, 2 and the bonus
Q = torch.tensor(RNG.dirichlet(np.full(V, 0.6), 2), dtype=torch.float32)


def run_rule(n: int = N_ROWS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drafts [n, 2], n_accepted [n], next_token [n]) from verify() on n rows of P and Q."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[j], n, replacement=True, generator=gen) for j in range(2)], dim=1)
    keys = [request_key(seed * n + i) for i in range(n)]
    sb = SamplingBatch(torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n),
                       torch.zeros(n, dtype=torch.bool), keys, False, [(1.0, 0, 1.0, 0.0)] * n, [0] * n)
    n_accepted, next_token = verify(drafts, torch.full((n,), 2), P.expand(n, 3, V), Q.expand(n, 2, V), sb)
    return drafts, n_accepted, next_token


def z_test(successes: int, trials: int, rate: float) -> float:
    """Two-sided p-value of a binomial count against its exact rate (normal approximation: n·rate ≫ 1)."""
    z = (successes - trials * rate) / math.sqrt(trials * rate * (1 - rate))
    return float(2 * norm.sf(abs(z)))


def g_test(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = Counter(tokens.tolist())
    obs = [counts[t] for t in range(V)]
    exp = (p.double() / p.double().sum() * len(tokens)).tolist()
    return float(power_divergence(obs, exp, lambda_="log-likelihood").pvalue)


def rule_p_values(seed: int = 0) -> dict[str, float]:
    drafts, n_acc, nxt = run_rule(seed=seed)
    first = torch.where(n_acc >= 1, drafts[:, 0], nxt)
    kept = n_acc >= 1
    second = torch.where(n_acc[kept] >= 2, drafts[kept, 1], nxt[kept])
    return {
        "acceptance 1": z_test(int(kept.sum()), N_ROWS, float(torch.minimum(P[0], Q[0]).sum())),
        "acceptance 2": z_test(int((n_acc >= 2).sum()), int(kept.sum()), float(torch.minimum(P[1], Q[1]).sum())),
        "token 1": g_test(first, P[0]),
        "token 2": g_test(second, P[1]),
    }


def test_rule_is_exact():
    p_values = rule_p_values()
    print({k: f"{v:.3f}" for k, v in p_values.items()})
    # Bonferroni over the four tests: the family's false alarm rate stays ALPHA.
    assert min(p_values.values()) > ALPHA / len(p_values)


def caught(mutant: str, size: float, monkeypatch) -> tuple[bool, dict[str, float]]:
    patch_rule_error(mutant, size, monkeypatch)
    p_values = rule_p_values(seed=1)
    return min(p_values.values()) < ALPHA / len(p_values), p_values


@pytest.mark.parametrize("mutant", ["acceptance_scaled", "residual_mixed_with_p"])
def test_five_percent_error_is_caught(mutant, monkeypatch):
    found, p_values = caught(mutant, 0.05, monkeypatch)
    print(mutant, {k: f"{v:.2e}" for k, v in p_values.items()})
    assert found


@pytest.mark.slow
@pytest.mark.parametrize("mutant", ["acceptance_scaled", "residual_mixed_with_p"])
def test_smallest_error_caught(mutant, monkeypatch):
    """Prints the smallest error of each kind the tests catch (docs/lossless.md quotes it)."""
    smallest = None
    for size in (0.04, 0.03, 0.02, 0.015, 0.01, 0.005):
        with monkeypatch.context() as m:
            if not caught(mutant, size, m)[0]:
                break
            smallest = size
    print(f"{mutant}: smallest error caught {smallest}")
    assert smallest is not None and smallest <= 0.05


def reference_probabilities(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                            min_p: float) -> np.ndarray:
    """The transforms as their definitions read, on one row: temperature, then the top_k likeliest, then the
    smallest set of likeliest whose mass reaches top_p, then tokens below min_p × the likeliest dropped."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[:top_k if top_k > 0 else len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        mass = np.cumsum(p[order])
        n = int(np.searchsorted(mass, top_p)) + 1  # the first prefix whose mass reaches top_p
        keep = np.zeros(len(z), bool)
        keep[order[:n]] = True
        p = np.where(keep, p, 0.0) / p[keep].sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5), SamplingParams(top_p=0.6),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9), SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.5, top_k=300, top_p=0.95, min_p=0.05),
])
def test_transforms_match_an_independent_reference(params):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1, 1000, generator=gen) * 3  # wide enough to pass the 256 candidates read first
    sb = SamplingBatch.build([params] * 6, [1] * 6, torch.device("cpu"))
    ours = probabilities(logits, sb)[:, 0].double().numpy()
    for row in range(6):
        ref = reference_probabilities(logits[row, 0].numpy(), params.temperature, params.top_k, params.top_p,
                                      params.min_p)
        assert np.array_equal(ours[row] > 0, ref > 0)
        np.testing.assert_allclose(ours[row], ref, atol=1e-6)
