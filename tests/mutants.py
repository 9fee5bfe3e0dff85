"""Deliberately broken verifiers and proposers. The distribution tests must FAIL with each one:
that is what shows they have teeth. Each mutant replaces one seam of the real code."""

from __future__ import annotations

import torch

import speculant.verify as verify_module
from speculant.proposers.draft_model import DraftModelProposer
from speculant.sampling import probabilities, sample


class GreedyDraftSoftmaxQ(DraftModelProposer):
    """Drafts the argmax but reports the softmax as q."""

    def draw(self, logits, sb):
        q = probabilities(logits, sb)[:, 0]
        return q.argmax(dim=-1), q


class TransformsOnTargetOnly(DraftModelProposer):
    """Samples under the request's transforms but reports q from the raw logits."""

    def draw(self, logits, sb):
        token = sample(probabilities(logits, sb)[:, 0], sb.generators)
        return token, torch.softmax(logits[:, 0].float(), dim=-1)


def _unnormalized_residual(p, q, rejected_token):
    if q is None:
        return p.scatter(-1, rejected_token[:, None], 0.0)
    return (p - q).clamp_min(0.0)


def inverse_cdf_sample(probs, generators):
    """Exact for a normalized distribution; trusts its input to sum to 1 (as many samplers do)."""
    out = probs.argmax(dim=-1)
    for row, gen in enumerate(generators):
        if gen is not None:
            u = torch.rand(1, generator=gen, device=probs.device)
            out[row] = torch.searchsorted(probs[row].cumsum(0), u).clamp(max=probs.shape[-1] - 1)[0]
    return out


PROPOSER_MUTANTS = {"greedy_draft_softmax_q": GreedyDraftSoftmaxQ,
                    "transforms_on_target_only": TransformsOnTargetOnly}


def patch_verifier(name: str, monkeypatch) -> None:
    if name == "residual_not_renormalized":
        monkeypatch.setattr(verify_module, "residual", _unnormalized_residual)
        monkeypatch.setattr(verify_module, "sample", inverse_cdf_sample)
    elif name == "acceptance_ignores_q":  # min(1, p(d)) while the residual still subtracts q
        monkeypatch.setattr(verify_module, "acceptance_probability", lambda p_d, q_d: p_d)
    else:
        raise ValueError(name)


VERIFIER_MUTANTS = ["residual_not_renormalized", "acceptance_ignores_q"]


def patch_native_sampler(name: str, monkeypatch) -> None:
    """Break the native sampler's seam (deterministic drafts, verify.verify_row)."""
    from speculant.models import native

    sample_row, token_probability = native.sample_row, native.token_probability
    if name == "residual_keeps_rejected_draft":
        monkeypatch.setattr(native, "sample_row", lambda row, t, u, exclude=-1: sample_row(row, t, u))
    elif name == "acceptance_at_temperature_1":
        monkeypatch.setattr(native, "token_probability",
                            lambda row, t, token: token_probability(row, (1.0, *t[1:]), token))
    elif name == "acceptance_without_top_p":
        monkeypatch.setattr(native, "token_probability",
                            lambda row, t, token: token_probability(row, (t[0], t[1], 1.0, t[3]), token))
    else:
        raise ValueError(name)


NATIVE_SAMPLER_MUTANTS = ["residual_keeps_rejected_draft", "acceptance_at_temperature_1", "acceptance_without_top_p"]
