"""The Responses API's stored responses: in memory, bounded in count and age (routes.py)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Stored:
    response: dict  # the Response object as it was returned
    messages: list[dict]  # the conversation it ended, as chat messages (without its instructions)
    at: float


class ResponseStore:
    """Responses kept for previous_response_id and GET: at most `size`, none older than `max_age_s`; the
    oldest go first."""

    def __init__(self, size: int = 1000, max_age_s: float = 3600.0):
        self.size, self.max_age_s = size, max_age_s
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, response: dict, messages: list[dict]) -> None:
        self.entries[rid] = Stored(response, messages, time.monotonic())
        self.expire()

    def get(self, rid: str) -> Stored | None:
        self.expire()
        return self.entries.get(rid)

    def delete(self, rid: str) -> bool:
        return self.entries.pop(rid, None) is not None

    def expire(self) -> None:
        now = time.monotonic()
        while self.entries and (len(self.entries) > self.size
                                or now - next(iter(self.entries.values())).at > self.max_age_s):
            self.entries.popitem(last=False)
