"""The draft tree's bookkeeping (proposers/draft_tree.py): where it grows, where it stops, what it keeps."""

from __future__ import annotations

import math

from speculant.proposers.draft_tree import DraftTree


def log(*ps: float) -> list[float]:
    return [math.log(p) for p in ps]


def test_budget_goes_deep_where_the_drafter_is_sure_and_wide_where_it_is_not():
    tree = DraftTree(budget=3, max_depth=4)
    tree.add_children(-1, [10, 11, 12], log(0.6, 0.3, 0.1))
    # The third first draft (0.1) is the budget-th best: no child of it can be kept.
    assert tree.frontier(width=3) == [0, 1]
    tree.add_children(0, [20, 21, 22], log(0.9, 0.05, 0.05))
    tree.add_children(1, [30, 31, 32], log(0.5, 0.3, 0.2))
    # Node 3 (10 → 20, 0.54) beats the 0.3 and 0.1 first drafts; 1 → 30 (0.15) and the rest do not.
    assert tree.frontier(width=3) == [3]
    tokens, parents = tree.best()
    assert tokens == [10, 11, 20]
    assert parents == [-1, -1, 0]


def test_frontier_keeps_the_width_best_of_the_newest_depth():
    tree = DraftTree(budget=20, max_depth=3)
    tree.add_children(-1, [1, 2], log(0.5, 0.5))
    assert tree.frontier(width=2) == [0, 1]
    tree.add_children(0, [3, 4], log(0.5, 0.1))  # 0.25, 0.05
    tree.add_children(1, [5, 6], log(0.4, 0.3))  # 0.2, 0.15
    assert tree.frontier(width=2) == [2, 4]
    tree.add_children(2, [7], log(0.9))
    assert tree.frontier(width=2) == []  # depth 3 is the limit
    assert tree.frontier(width=2) == []  # nothing new


def test_best_lists_parents_before_children_and_indexes_among_the_kept():
    tree = DraftTree(budget=4, max_depth=3)
    tree.add_children(-1, [1, 2, 3], log(0.4, 0.35, 0.25))
    tree.frontier(width=3)
    tree.add_children(1, [4], log(0.99))  # 0.3465: node 3, its parent node 1
    tree.add_children(0, [5], log(0.5))  # 0.2: node 4
    tokens, parents = tree.best()
    assert tokens == [1, 2, 3, 4]
    assert parents == [-1, -1, -1, 1]
    assert all(p < i for i, p in enumerate(parents))


def test_a_certain_child_ties_its_parent_and_still_follows_it():
    tree = DraftTree(budget=2, max_depth=2)
    tree.add_children(-1, [1, 2], [0.0, -50.0])
    tree.frontier(width=1)
    tree.add_children(0, [3], [0.0])  # the same score as its parent
    assert tree.best() == ([1, 3], [-1, 0])


def test_a_pass_over_the_frontiers_branches_fits_a_tree_pass():
    """The head grows a depth in one tree pass over the frontier's branches: no more nodes than a pass's
    tree holds, the best-scored frontier nodes first."""
    tree = DraftTree(budget=32, max_depth=5)
    tree.add_children(-1, [1, 2, 3], [-0.1, -0.2, -0.3])
    assert tree.frontier(width=3, max_nodes=3) == [0, 1, 2]
    tree.add_children(0, [4], [-0.5])  # node 3: -0.6
    tree.add_children(1, [5], [-0.1])  # node 4: -0.3
    tree.add_children(2, [6], [-0.1])  # node 5: -0.4
    # Nodes 4 and 5 take 4 nodes with their parents; node 3 would make 6.
    assert tree.frontier(width=3, max_nodes=4) == [4, 5]
