"""Thoughts kept apart: a thinking model's `<think>…</think>` split from its answer, whole and streamed.

As llama.cpp's `--reasoning-format` and vLLM's reasoning parsers do it: a thought is the text between the
opening tag at the very start of the answer (or in the prompt, where the chat template opens it: DeepSeek-R1,
Qwen3's thinking templates) and the first closing tag; everything after the closing tag is the answer. Nothing
is stripped or added: the answer's raw text is `[open] + reasoning + close + content` exactly. A thought never
closed (max_tokens reached inside it) is all reasoning. Streaming holds back a tail that could still become a
tag, so a tag split across pieces never leaks into either part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

REASONING_PARSERS = ("auto", "think", "none")


@dataclass(frozen=True)
class ThinkTags:
    open: str = "<think>"
    close: str = "</think>"


THINK = ThinkTags()


def reasoning_tags(parser: str, vocab: dict[str, int] | None, chat_template: str | None) -> ThinkTags | None:
    """The tags `--reasoning-parser` names: "think" always, "none" never, "auto" where the model thinks (its
    tokenizer has both tags as tokens, or its chat template writes the closing one)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(REASONING_PARSERS)}")
    if parser == "none":
        return None
    if parser == "think":
        return THINK
    in_vocab = vocab is not None and THINK.open in vocab and THINK.close in vocab
    return THINK if in_vocab or THINK.close in (chat_template or "") else None


def held_tail(text: str, tag: str) -> int:
    """The length of `text`'s longest tail that is a proper beginning of `tag` (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThoughtSplitter:
    """One answer's text, pushed in pieces → (reasoning, content) pieces. `opened`: the prompt opened the
    thought, so the answer starts inside it."""

    def __init__(self, tags: ThinkTags, opened: bool = False):
        self.tags = tags
        self.state = "thought" if opened else "start"  # start → thought → answer, or start → answer
        self.thought = opened  # a thought was opened (by the prompt or the answer)
        self.held = ""  # text that may still become a tag
        self.length = 0  # characters pushed so far
        self.thought_end: int | None = None  # where the closing tag ends in the raw text, once it has come

    def push(self, piece: str) -> tuple[str, str]:
        """More of the answer's text → (reasoning, content) that can be sent now."""
        self.length += len(piece)
        text, self.held = self.held + piece, ""  # always a tail of the raw text
        if self.state == "start":
            if text.startswith(self.tags.open):
                self.state, self.thought, text = "thought", True, text[len(self.tags.open):]
            elif self.tags.open.startswith(text):
                self.held = text
                return "", ""
            else:
                self.state = "answer"
        reasoning = ""
        if self.state == "thought":
            at = text.find(self.tags.close)
            if at < 0:
                keep = held_tail(text, self.tags.close)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            self.thought_end = self.length - len(text) + at + len(self.tags.close)
            reasoning, text, self.state = text[:at], text[at + len(self.tags.close):], "answer"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The answer is complete → what was held back: reasoning inside an unclosed thought, else content."""
        rest, self.held = self.held, ""
        if self.state == "thought":
            return rest, ""
        self.state = "answer"
        return "", rest


@dataclass(frozen=True)
class ReasoningParser:
    """A request's parser: the model's tags, and whether its prompt opened the thought."""

    tags: ThinkTags
    opened: bool

    def splitter(self) -> ThoughtSplitter:
        return ThoughtSplitter(self.tags, self.opened)

    def split(self, text: str) -> tuple[str | None, str, int]:
        """A whole answer → (its thought, None where it had none; its content; where the thought ends in `text`)."""
        s = self.splitter()
        reasoning, content = s.push(text)
        more_reasoning, more_content = s.finish()
        return (reasoning + more_reasoning if s.thought else None), content + more_content, thought_end(s)


def thought_end(splitter: ThoughtSplitter) -> int:
    """Characters of the raw answer that belong to the thought, tags included (all of it where the thought
    never closed, none where there was none)."""
    if splitter.thought_end is not None:
        return splitter.thought_end
    return splitter.length if splitter.thought else 0


def opens_thought(tags: ThinkTags, prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a thought open (its template wrote the opening tag)."""
    return prompt_tail.rstrip().endswith(tags.open)


def reasoning_tokens(ids: list[int], end: int, decode: Callable[[list[int]], str]) -> int:
    """How many of an answer's tokens `ids` wrote its first `end` characters (the thought, tags included): the
    fewest whose text reaches that far."""
    if end <= 0:
        return 0
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return hi
