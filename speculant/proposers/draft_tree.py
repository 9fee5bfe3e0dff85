"""A draft tree grown where the drafter is confident (EAGLE-2, Li et al. 2024).

A node's score is the drafter's log-probability of its whole branch, Σ log q along the path: its own
estimate that the target takes that branch. Growing one depth at a time, the `width` best nodes of
the newest depth each get their `width` likeliest children; at the end the `budget` best nodes are
verified. A child never scores above its parent, so the best nodes always include their ancestors,
and a node scoring below the budget-th best cannot have a child that enters: growth stops there.

A chain spends the budget on one branch however unsure its later drafts are; this tree puts it where
the drafter expects the target to go: a second guess at depth 1 when the first is unsure, a long
branch where it is sure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from speculant.models.attention import MAX_TREE_NODES
from speculant.proposers.base import chain_padded, pad_rows


@dataclass
class DraftTree:
    budget: int  # nodes verified
    max_depth: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: a child of the sequence's last token
    scores: list[float] = field(default_factory=list)  # the branch's Σ log q
    depths: list[int] = field(default_factory=list)  # 1 for a first draft
    newest: list[int] = field(default_factory=list)  # the nodes of the last depth grown

    def add_children(self, parent: int, tokens: list[int], log_q: list[float]) -> None:
        """Children of node `parent` (-1: the root), likeliest first."""
        base, depth = (0.0, 1) if parent < 0 else (self.scores[parent], self.depths[parent] + 1)
        for token, lq in zip(tokens, log_q):
            self.newest.append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(base + lq)
            self.depths.append(depth)

    def frontier(self, width: int, max_nodes: int = MAX_TREE_NODES) -> list[int]:
        """The nodes to grow next: the `width` best of the newest depth, those whose children could
        still be among the budget best nodes, as many as a pass of their branches holds (max_nodes);
        none at the depth limit. Resets `newest`."""
        newest, self.newest = self.newest, []
        if not newest or self.depths[newest[0]] >= self.max_depth:
            return []
        ranked = sorted(self.scores, reverse=True)
        floor = ranked[self.budget - 1] if len(ranked) >= self.budget else float("-inf")
        chosen: list[int] = []
        for n in sorted(newest, key=lambda n: -self.scores[n])[:width]:
            if self.scores[n] > floor and len(self.branches([*chosen, n])) <= max_nodes:
                chosen.append(n)
        return sorted(chosen)

    def branches(self, nodes: list[int]) -> list[int]:
        """`nodes` and all their ancestors, parents before children."""
        keep: set[int] = set()
        for n in nodes:
            while n >= 0 and n not in keep:
                keep.add(n)
                n = self.parents[n]
        return sorted(keep)

    def best_probs(self, extra: list[int] = ()) -> list[float]:
        """The budget best branch probabilities, best first; each node of `extra` counted once more (as a child of
        its own, as likely as itself: an upper bound on what growing it adds)."""
        return sorted((math.exp(s) for s in self.scores + [self.scores[n] for n in extra]), reverse=True)[:self.budget]

    def best(self) -> tuple[list[int], list[int]]:
        """The budget best nodes, parents before children → (their tokens, their parents as indices
        among them, -1 for the root's children)."""
        chosen = sorted(sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], n))[:self.budget])
        where = {n: i for i, n in enumerate(chosen)}
        return [self.tokens[n] for n in chosen], [where[p] if (p := self.parents[n]) >= 0 else -1 for n in chosen]


@dataclass
class BranchPass:
    """One drafting pass over the branches of the nodes grown[b] of each row's tree, laid out as a tree pass
    takes it: each node sees its own ancestors only."""
    rows: list[int]  # the rows that grow a node
    branches: list[list[int]]  # each such row's nodes in the pass, parents first
    tokens: torch.Tensor  # [B', T]
    n_new: torch.Tensor  # [B']
    where: list[dict[int, int]]  # node → its place in the pass
    parents: list[list[int]]  # each row's parents as places in the pass (-1: the cache), padded to T


def branch_pass(trees: list[DraftTree], grown: list[list[int]], device: torch.device) -> BranchPass:
    rows = [b for b, nodes in enumerate(grown) if nodes]
    branches = [trees[b].branches(grown[b]) for b in rows]
    tokens, n_new = pad_rows([[trees[b].tokens[n] for n in nodes] for b, nodes in zip(rows, branches)], device)
    where = [{n: i for i, n in enumerate(nodes)} for nodes in branches]
    parents = [chain_padded([w.get(trees[b].parents[n], -1) for n in nodes], tokens.shape[1])
               for b, nodes, w in zip(rows, branches, where)]
    return BranchPass(rows, branches, tokens, n_new, where, parents)
