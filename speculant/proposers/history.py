"""Drafts from the answers the target gave before (the global half of SuffixDecoding, Oliaro et al., 2024;
vLLM's "suffix" method): requests repeat — the same question asked again, a template filled once more,
an agent's next tool call — and an earlier answer continues a new one where their last tokens agree.
Prompt lookup reads the request itself, the corpus table what the target most often writes; this reads
what it wrote lately, in the order the requests finished.

The history keeps answers, each after its prompt's last CONTEXT tokens (so that a repeated request finds
its answer from the first token), up to `max_tokens` tokens in all; past that the oldest half goes. A
draft continues the latest earlier answer whose CONTEXT tokens before it equal the sequence's last ones
(8: shorter contexts let unrelated answers push out better drafts).

Opt-in ("history_tokens" in the speculative config): a request's drafts, and so its speed, then depend on
the requests served before it — never its output, every draft is verified — which tells a client who
times its requests something about other clients' answers.
"""

from __future__ import annotations

from collections import deque

HISTORY_BUCKET = 20  # adaptive k's acceptance bucket for history drafts
CONTEXT = 8
END = -1  # after each answer: a draft stops there, and no token equals it


class AnswerHistory:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: deque[tuple[list[int], list[int]]] = deque()  # (lead, answer), oldest first
        self.size = 0  # tokens the entries take in `tokens`, each END included
        self._rebuild()

    def learn(self, prompt: list[int], answer: list[int]) -> None:
        """Keep `answer` (the newest) after its prompt's last tokens, forgetting the oldest half of the
        history when it is full (the index is rebuilt once per max_tokens / 2 tokens learned)."""
        lead = prompt[-CONTEXT:]
        answer = answer[:max(0, self.max_tokens - len(lead) - 1)]
        if not answer:
            return
        self.entries.append((lead, answer))
        self.size += len(lead) + len(answer) + 1
        if self.size <= self.max_tokens:
            self._append(lead, answer)
            return
        while self.size > self.max_tokens // 2 and len(self.entries) > 1:
            old_lead, old_answer = self.entries.popleft()
            self.size -= len(old_lead) + len(old_answer) + 1
        self._rebuild()

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the sequence's last CONTEXT tokens in the latest earlier answer."""
        at = self.latest.get(tuple(tokens[-CONTEXT:])) if len(tokens) >= CONTEXT else None
        if at is None:
            return []
        drafts = []
        for token in self.tokens[at:at + k]:
            if token == END:
                break
            drafts.append(token)
        return drafts

    def _rebuild(self) -> None:
        self.tokens = [END]
        self.latest: dict[tuple[int, ...], int] = {}  # context → the position after its latest occurrence
        for lead, answer in self.entries:
            self._append(lead, answer)

    def _append(self, lead: list[int], answer: list[int]) -> None:
        start, text = len(self.tokens), lead + answer
        for i in range(max(CONTEXT, len(lead)), len(text)):  # contexts followed by an answer token
            self.latest[tuple(text[i - CONTEXT:i])] = start + i
        self.tokens += text
        self.tokens.append(END)
