"""The order in which waiting sequences get a free cache row."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable

from speculant.sequence import Sequence


def first_come(waiting: Iterable[Sequence]) -> list[Sequence]:
    return list(waiting)


class RoundRobin:
    """Turns across owners, each owner's sequences in arrival order: the next free row goes to the owner that
    has had the fewest so far (a server request asking for n choices does not hold every row while others wait)."""

    def __init__(self, owner: Callable[[Sequence], Hashable]):
        self.owner = owner

    def __call__(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        queues: dict[Hashable, deque[Sequence]] = {}
        for seq in waiting:
            queues.setdefault(self.owner(seq), deque()).append(seq)
        order, pending = [], list(queues.values())
        while pending:
            order += [q.popleft() for q in pending]
            pending = [q for q in pending if q]
        return order
