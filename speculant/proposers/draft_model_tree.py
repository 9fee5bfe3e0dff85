"""A draft model's drafts as a tree (draft_tree.py, EAGLE-2's growth), the whole tree verified in one target pass.

A chain spends a verify pass's width on one guess at each position and breaks at the first miss; where the pass is
nearly flat (C(8)/C(1) ~1.2 on the avx512 kernels), a second guess where the draft is unsure costs little more.

Growth. The pass that feeds the draft the verifier's last tokens (paid anyway, as a chain's first draft) gives the
root's tree_width likeliest tokens; then each depth is one draft pass over the branches of the nodes grown, a tree
pass (models/llama.py) so that each node attends to its own ancestors only, from the draft's entries of the
sequence's real tokens: those branches' keys are computed again at each depth (a pass over a few rows costs about
one), and the cache needs no mask of its own. A node is grown only where the draft's probability of its whole
branch is at least p_chain (the chain's rule: a tree of width 1 is a p_chain chain), checked before the pass it
would cost; p_min keeps a node's children out where the draft's likeliest one is below it.

The draft's cache. After the last pass the draft's rows go back to the real tokens' entries: the accepted branch
is fed at the next step with the verifier's token after it (catch_up), so only the sequence's own tokens are ever
in the cache, as if decoded alone.

Size. The pass verifies the N best nodes, N chosen each step from the target's measured cost curve and this step's
drafting time (TreeSize): on a flat curve the whole budget, where passes are not flat (avx2 levels) fewer. The same
model stops the growth where another draft pass could not pay, even were each grown node's best child as likely as
the node itself.

Exact. Every candidate is deterministic (the draft's likeliest tokens; q None) and verified by coupling
(verify.py): greedy output is plain greedy output, and a seeded sampled request writes plain decoding's tokens.

Batches. From chain_from_batch rows on the proposer drafts chains (draft_model.py): a batch's verify pass is
compute-bound, the tree's extra nodes would widen every row's pass, and adaptive k sizes a chain for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from speculant.models.loader import LoadedModel
from speculant.proposers.base import Proposal, TargetHidden, chain_padded
from speculant.proposers.draft_model import DraftModelProposer
from speculant.proposers.draft_tree import DraftTree, branch_pass
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence
from speculant.speedup import CostCurve

# Until drafts are seen, accepted drafts are taken to match the draft's own estimate (a calibration of 1) with the
# weight of this many drafts.
PRIOR_DRAFTS = 2.0


@dataclass
class TreeSize:
    """How many of a tree's best nodes a pass verifies: the N that maximises

        S(N) = mean_b(1 + c · Σ_{i ≤ N} P_b,i) / (C_B(N + 1)/C_B(1) + d)

    with P_b,i the draft's probability of row b's i-th best branch (its estimate that the target takes it: a node's
    expected contribution to the accepted length), c the accepted drafts over that estimate, measured and decayed
    (a draft is over- or under-confident), and d this step's drafting time over C_B(1) (already paid, it weighs
    every N alike but sets how much a wider pass adds to the step). design.md §3's S, with E summed over a tree."""

    curve: Callable[[], CostCurve] | None  # None: the whole budget, always
    predicted: float = PRIOR_DRAFTS
    accepted: float = PRIOR_DRAFTS
    memory: float = 0.95  # ~20 steps

    @property
    def calibration(self) -> float:
        return self.accepted / self.predicted

    def choose(self, probs: list[list[float]], batch_size: int, draft_s: float) -> int:
        """N for trees whose nodes' branch probabilities are probs[b], best first."""
        most = max(len(p) for p in probs)
        if self.curve is None or most <= 1:
            return most
        return self.best(probs, batch_size, draft_s)[0]

    def best(self, probs: list[list[float]], batch_size: int, draft_s: float) -> tuple[int, float]:
        """(N, S(N)) at the best N."""
        costs = self.curve()
        d = draft_s / costs.cost(batch_size, 1)
        c = self.calibration
        sums = [[0.0] + list(_running_sums(p)) for p in probs]

        def speedup(n: int) -> float:
            tokens = sum(1 + c * s[min(n, len(s) - 1)] for s in sums) / len(sums)
            return tokens / (costs.ratio(batch_size, n + 1) + d)

        n = max(range(1, max(len(p) for p in probs) + 1), key=lambda n: (speedup(n), -n))
        return n, speedup(n)

    def worth_growing(self, trees: list[DraftTree], grown: list[list[int]], batch_size: int, draft_s: float,
                      pass_s: float) -> bool:
        """Whether a growth pass (costing about pass_s, the step's last draft pass) can pay: the best S with each
        grown node given a child as likely as itself, an upper bound (a child never scores above its parent),
        against the best S of the nodes there are. Where passes are not flat the verified nodes stop short of
        what the growth would add, and the pass would be paid for nothing."""
        if self.curve is None:
            return True
        now = self.best([t.best_probs() for t in trees], batch_size, draft_s)[1]
        grow = self.best([t.best_probs(g) for t, g in zip(trees, grown)], batch_size, draft_s + pass_s)[1]
        return grow > now

    def observe(self, predicted: float, accepted: int) -> None:
        """A row's verified nodes summed to `predicted` (Σ P), and the verifier kept `accepted` of its drafts."""
        self.predicted = self.memory * self.predicted + predicted
        self.accepted = self.memory * self.accepted + accepted


def _running_sums(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


class DraftModelTreeProposer(DraftModelProposer):
    name = "draft_model+tree"

    def __init__(self, draft: LoadedModel, target_vocab_size: int, max_batch_size: int, max_len: int,
                 vocab_size: int = 0, p_min: float = 0.0, p_chain: float = 0.0, tree_width: int = 2,
                 max_depth: int = 4, costs: Callable[[], CostCurve] | None = None, chain_from_batch: int = 2):
        # A growth pass writes the branches of the grown nodes past the sequence's entries: room for them.
        super().__init__(draft, target_vocab_size, max_batch_size, max_len + tree_width * max_depth, vocab_size,
                         p_min, p_chain)
        self.tree_width = tree_width
        self.extra_nodes = tree_width - 1  # k + tree_width - 1 nodes at most, as the EAGLE head's trees
        self.chain_from_batch = chain_from_batch
        self.size = TreeSize(costs)
        self.pending: dict[str, tuple[int, float]] = {}  # row → (its tokens when drafted, Σ P of its nodes)

    def extra_nodes_at(self, batch_size: int) -> int:
        """0 where TreeSize sizes the tree from the curve: it adds a sibling only where the wider pass pays, so
        adaptive k judges the depth as a chain's (counted as always there, the siblings kept the drafter off on
        chat, where a chain of one draft paid)."""
        return self.extra_nodes if batch_size < self.chain_from_batch and self.size.curve is None else 0

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        """Trees for the rows with ks[b] > 0 (at most ks[b] deep) while the batch is below chain_from_batch,
        chains from there on."""
        rows = [b for b, k in enumerate(ks) if k]
        if not rows:
            return Proposal.empty(len(seqs), self.model.device)
        sub, sub_ks = [seqs[b] for b in rows], [ks[b] for b in rows]
        if len(seqs) >= self.chain_from_batch:
            proposal = self.draft_chain(sub, sub_ks, sb.select(rows))
        else:
            proposal = self.draft_trees(sub, sub_ks, len(seqs))
        return proposal.placed(rows, len(seqs))

    def draft_trees(self, seqs: list[Sequence], ks: list[int], batch_size: int) -> Proposal:
        """Row b's tree of at most ks[b] + tree_width − 1 nodes, ks[b] deep, its size trimmed by TreeSize."""
        t0 = time.perf_counter()
        device = self.model.device
        slots = torch.tensor([self.slot[s.request_id] for s in seqs], device=device)
        hidden = self.catch_up(seqs)  # [B, 1, D]
        real = self.cache.lengths[slots].clone()  # the entries of the sequences' own tokens
        width = self.tree_width
        trees = [DraftTree(k + width - 1, k) for k in ks]
        self.add_children(trees, [[-1] for _ in trees], hidden)
        pass_s = time.perf_counter() - t0
        while any(grown := [self.to_grow(tree) for tree in trees]):
            if not self.size.worth_growing(trees, grown, batch_size, time.perf_counter() - t0, pass_s):
                break
            t1 = time.perf_counter()
            self.grow(trees, grown, slots, real)
            pass_s = time.perf_counter() - t1
        self.forget_branches(seqs, slots, real)
        probs = [tree.best_probs() for tree in trees]
        n = self.size.choose(probs, batch_size, time.perf_counter() - t0)
        for tree, s, p in zip(trees, seqs, probs):
            tree.budget = min(tree.budget, n)
            self.pending[s.request_id] = (len(s.tokens), sum(p[:tree.budget]))
        drafts, parents = zip(*(tree.best() for tree in trees))
        proposal = Proposal.from_lists(list(drafts), device)
        if any(p != list(range(-1, len(p) - 1)) for p in parents):
            # Trees trimmed to chains go as chains: the pass then takes the native chain path and carries riders.
            proposal.parents = [chain_padded(p, proposal.tokens.shape[1]) for p in parents]
        return proposal

    def forget_branches(self, seqs: list[Sequence], slots: torch.Tensor, real: torch.Tensor) -> None:
        """Back to the entries of the sequences' own tokens: the branches' were guesses, and the pass that grew
        them holds any branch's keys, not the one the verifier keeps (it is fed at the next step)."""
        self.cache.lengths[slots] = real

    def to_grow(self, tree: DraftTree) -> list[int]:
        """The frontier of the newest depth (DraftTree.frontier), those nodes whose branch the draft gives at
        least p_chain: decided before the pass that would grow them."""
        floor = math.log(self.p_chain) if self.p_chain else -math.inf
        return [n for n in tree.frontier(self.tree_width) if tree.scores[n] >= floor]

    def grow(self, trees: list[DraftTree], grown: list[list[int]], slots: torch.Tensor, real: torch.Tensor) -> None:
        """One draft pass over the branches of the nodes grown[b] of each row, from its `real` entries, a tree so
        each node sees its own ancestors only; the grown nodes get their children."""
        device = slots.device
        layout = branch_pass(trees, grown, device)
        rows, where = layout.rows, layout.where
        at = torch.tensor(rows, device=device)
        self.cache.lengths[slots[at]] = real[at]
        hidden = self.model(layout.tokens, self.cache, slots[at], layout.n_new, layout.parents)  # [B', T, D]
        most = max(len(grown[b]) for b in rows)
        index = torch.tensor([[w[n] for n in grown[b]] + [0] * (most - len(grown[b])) for b, w in zip(rows, where)],
                             device=device)
        picked = hidden[torch.arange(len(rows), device=device)[:, None], index]  # [B', most, D]
        self.add_children([trees[b] for b in rows], [grown[b] for b in rows], picked)

    def add_children(self, trees: list[DraftTree], grown: list[list[int]], hidden: torch.Tensor) -> None:
        """Give each node of grown[i] (-1: the row's newest token) its tree_width likeliest children by the
        draft's log-softmax (over its vocabulary) at its hidden state hidden[i, j]; none where the likeliest is
        below p_min (a grown node only: the root's are the first drafts, whose pass is paid anyway)."""
        log_q = torch.log_softmax(self._logits(hidden).float(), dim=-1)
        top = log_q.topk(self.tree_width, dim=-1)  # [B, n, width]
        ids = self._target_ids(top.indices).tolist()
        scores = top.values.tolist()
        floor = math.log(self.p_min) if self.p_min else -math.inf
        for tree, nodes, row_ids, row_scores in zip(trees, grown, ids, scores):
            for node, children, lq in zip(nodes, row_ids, row_scores):
                if node < 0 or lq[0] >= floor:
                    tree.add_children(node, children, lq)

    def _target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Columns of the draft's logits → the target's token ids."""
        return index if self.draft_ids is None else self.draft_ids[index]

    def commit(self, seqs: list[Sequence], target: TargetHidden) -> None:
        for s in seqs:
            drafted = self.pending.pop(s.request_id, None)
            if drafted is not None:
                before, predicted = drafted
                # The step appended the accepted drafts and the target's next token (fewer where it stopped).
                self.size.observe(predicted, max(len(s.tokens) - before - 1, 0))
        super().commit(seqs, target)

    def remove(self, seq: Sequence) -> None:
        self.pending.pop(seq.request_id, None)
        super().remove(seq)
