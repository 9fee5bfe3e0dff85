"""The acceptance rule (Leviathan et al. 2022; Chen et al. 2023), batched.

For draft token d_j drawn from q_j, with target distribution p_j (both after the request's
transforms): accept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw
from normalize(max(0, p_j - q_j)); when all drafts pass, draw a bonus token from p_{k+1}.
A deterministic proposer (q = None) is the one-hot case: accept with probability p_j(d_j),
on rejection draw from p_j without d_j. Greedy rows arrive here as one-hot p and draw no
randomness, which makes the rule plain greedy verification; `verify_greedy` is that case computed
from the target's argmax alone, without building [B, k+1, V] one-hot distributions.
"""

from __future__ import annotations

import torch

from speculant.models import native
from speculant.sampling import SamplingBatch, argmax, probabilities, sample, uniforms


def verify_logits(draft: torch.Tensor, n_draft: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None,
                  sb: SamplingBatch) -> tuple[list[int], list[int]]:
    """`verify` from the target's logits [B, k+1, V] under the batch's sampling transforms, as lists.

    Deterministic drafts (q None) go to the native sampler row by row (verify_row) where it runs; a
    draft model's (they carry q) to `verify`, which compares the two distributions."""
    if sb.all_greedy:
        return verify_greedy(draft.tolist(), n_draft.tolist(), argmax(logits).tolist())
    if q is not None or not native.sampling_usable(logits):
        n_accepted, next_tokens = verify(draft, n_draft, probabilities(logits, sb), q, sb.generators)
        return n_accepted.tolist(), next_tokens.tolist()
    logits = logits.contiguous()
    rows = [verify_row(tokens[:n], logits[b], sb.transforms[b], sb.generators[b])
            for b, (tokens, n) in enumerate(zip(draft.tolist(), n_draft.tolist()))]
    return [n for n, _ in rows], [token for _, token in rows]


def verify_row(drafts: list[int], logits: torch.Tensor, transforms: native.Transforms,
               generator: torch.Generator | None) -> tuple[int, int]:
    """`verify` for one row of deterministic drafts on the native sampler: logits [k+1, V] under the
    request's (temperature, top_k, top_p, min_p), temperature 0 for greedy → (drafts accepted, next token).
    Each draft is accepted with probability p(d); at the first rejection the next token is drawn from p
    without d, else from the last position's p. The row's generator makes the draws `verify` makes: k
    uniforms, then one in fp64. A row's result depends on its own logits and generator only: a seeded
    request draws alike in any batch.

    In PyTorch a sampled row took ~10 operations over the vocabulary per position (0.39 ms of a 2.8 ms
    plain int4 step for SmolLM2 at temperature 0.7, 0.94 ms of 3.9 with top_p 0.9); here two passes."""
    if generator is None:
        (run,), (token,) = verify_greedy([drafts], [len(drafts)], [argmax(logits).tolist()])
        return run, token
    k = logits.shape[0] - 1
    u = torch.rand(k, generator=generator, device=logits.device).tolist() if k else []
    run = 0
    while run < len(drafts) and u[run] < native.token_probability(logits[run], transforms, drafts[run]):
        run += 1
    final = float(torch.rand(1, generator=generator, dtype=torch.float64, device=logits.device))
    return run, native.sample_row(logits[run], transforms, final, drafts[run] if run < len(drafts) else -1)


def verify_tree_logits(draft: torch.Tensor, n_draft: torch.Tensor, parents: list[list[int]], logits: torch.Tensor,
                       sb: SamplingBatch) -> tuple[list[list[int]], torch.Tensor]:
    """`verify_tree` from the target's logits [B, k+1, V] under the batch's sampling transforms."""
    if sb.all_greedy:
        return verify_tree_greedy(draft, n_draft, parents, argmax(logits))
    return verify_tree(draft, n_draft, parents, probabilities(logits, sb), sb.generators)


def verify_tree_greedy(draft: torch.Tensor, n_draft: torch.Tensor, parents: list[list[int]],
                       target: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy verification of draft trees (see Proposal.parents): from the sequence's last token, follow
    the child whose token is the target's there, while one is. target [B, k+1]: the target's token
    after the last token (column 0) and after each draft j (column j + 1) → (each row's accepted
    drafts, root to leaf, as draft indices; the next token [B], the target's after the last accepted)."""
    drafts, targets, n_real = draft.tolist(), target.tolist(), n_draft.tolist()
    paths, next_tokens = [], []
    for tokens, wanted, tree, n in zip(drafts, targets, parents, n_real):
        path, node = [], -1
        while (child := next((j for j in range(n) if tree[j] == node and tokens[j] == wanted[node + 1]),
                             None)) is not None:
            path.append(child)
            node = child
        paths.append(path)
        next_tokens.append(wanted[node + 1])
    return paths, torch.tensor(next_tokens, device=draft.device)


def verify_tree(draft: torch.Tensor, n_draft: torch.Tensor, parents: list[list[int]], p: torch.Tensor,
                generators: list[torch.Generator | None]) -> tuple[list[list[int]], torch.Tensor]:
    """`verify` for trees of deterministic drafts (see Proposal.parents): at each node its children are
    tried in order, each kept with the probability the target gives it once the siblings tried before
    it are ruled out (the one-hot case of the rule, its residual in turn: recursive rejection sampling,
    SpecInfer, Miao et al. 2023); a kept child becomes the node, and when every child is rejected the
    next token is drawn from what is left.

    p [B, k+1, V]: after the last token (0) and after each draft j (j + 1) → (each row's accepted
    drafts, root to leaf; the next token [B])."""
    paths, next_tokens = [], []
    for b, (tokens, tree, n, gen) in enumerate(zip(draft.tolist(), parents, n_draft.tolist(), generators)):
        path, node, target = [], -1, p[b, 0]
        while True:
            for j in (j for j in range(n) if tree[j] == node):
                u = 0.0 if gen is None else float(torch.rand(1, generator=gen, device=p.device))
                if u < float(acceptance_probability(target[tokens[j]], None)):
                    path.append(j)
                    node, target = j, p[b, j + 1]
                    break
                target = residual(target[None], None, draft[b, j:j + 1])[0]
            else:
                break
        paths.append(path)
        next_tokens.append(sample(target[None], [gen]))
    return paths, torch.cat(next_tokens)


def verify_greedy(draft: list[list[int]], n_draft: list[int], target: list[list[int]]) -> tuple[list[int], list[int]]:
    """`verify` with one-hot p at target [B][k+1] (the argmax tokens): a draft is accepted while it
    equals the target's token, and the next token is the target's at the first mismatch. On lists: a
    step's few tokens cost less in Python than in PyTorch's dispatch."""
    n_accepted = []
    for tokens, wanted, n in zip(draft, target, n_draft):
        run = 0
        while run < n and tokens[run] == wanted[run]:
            run += 1
        n_accepted.append(run)
    return n_accepted, [wanted[run] for wanted, run in zip(target, n_accepted)]


def verify(draft: torch.Tensor, n_draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (n_accepted [B], next_token [B]).

    draft [B, k] tokens, of which the first n_draft[b] are real in row b;
    p [B, k+1, V] target probabilities at each draft position and after the last;
    q [B, k, V] the distributions the drafts were drawn from, or None (deterministic proposer).
    """
    B, k = draft.shape
    rows = torch.arange(B, device=draft.device)
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    q_d = None if q is None else q.gather(-1, draft[..., None]).squeeze(-1)
    n_accepted = accepted_run(uniforms(k, generators, draft.device) < acceptance_probability(p_d, q_d), n_draft)

    p_next = p[rows, n_accepted]  # [B, V]
    rejected = n_accepted < n_draft
    if k and bool(rejected.any()):
        at = n_accepted.clamp(max=k - 1)
        fix = residual(p_next, None if q is None else q[rows, at], draft[rows, at])
        p_next = torch.where(rejected[:, None], fix, p_next)
    return n_accepted, sample(p_next, generators)


def accepted_run(accepted: torch.Tensor, n_draft: torch.Tensor) -> torch.Tensor:
    """accepted [B, k] per draft → [B] how many drafts in a row were accepted, counting only each
    row's first n_draft[b] (the rest is padding)."""
    real = torch.arange(accepted.shape[1], device=accepted.device)[None, :] < n_draft[:, None]  # [B, k]
    return (accepted & real).int().cumprod(dim=1).sum(dim=1)


def acceptance_probability(p_d: torch.Tensor, q_d: torch.Tensor | None) -> torch.Tensor:
    """p(d) / q(d), compared with a uniform draw (so capped at 1 in effect); q = None is one-hot."""
    if q_d is None:
        return p_d
    return torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), 0.0)


def residual(p: torch.Tensor, q: torch.Tensor | None, rejected_token: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) [B, V]: what to draw from after rejecting a draft drawn from q.
    With q = None (one-hot at the rejected token) that is p without the token."""
    if q is None:
        out = p.scatter(-1, rejected_token[:, None], 0.0)
    else:
        out = (p - q).clamp_min(0.0)
    mass = out.sum(dim=-1, keepdim=True)
    # A zero residual only happens when p == q (up to rounding): then p itself is the answer.
    return torch.where(mass > 0, out / mass.clamp_min(1e-30), p)
