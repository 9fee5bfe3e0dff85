"""The reasoning parser (speculant/server/chat/reasoning.py) on piece sequences: every way to cut an answer into pieces
gives the whole answer's split; a tag split across pieces never leaks; broken splitters are caught."""

from __future__ import annotations

import itertools

import pytest

from speculant.server.chat.reasoning import (
    THINK,
    ReasoningParser,
    ThoughtSplitter,
    opens_thought,
    reasoning_tags,
    reasoning_tokens,
)

# (raw answer, the prompt opened the thought, expected reasoning (None: no thought), expected content)
CASES = [
    ("<think>\nlet me see\n</think>\n\nParis.", False, "\nlet me see\n", "\n\nParis."),
    ("let me see</think>Paris.", True, "let me see", "Paris."),
    ("Paris.", False, None, "Paris."),
    ("", False, None, ""),
    ("", True, "", ""),
    ("<think>still thinking when max_tokens hit <", False, "still thinking when max_tokens hit <", ""),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("<thin", False, None, "<thin"),  # cut short before the tag was whole: not a thought
    ("<thinking>x</think>y", False, None, "<thinking>x</think>y"),  # not the tag
    (" <think>a</think>b", False, None, " <think>a</think>b"),  # a thought only at the very start
    ("<think></think>answer <think>again</think>", False, "", "answer <think>again</think>"),
    ("a < b </ c </think </think>done", True, "a < b </ c </think ", "done"),
    ("<<think>x", False, None, "<<think>x"),
]


def cuts(text: str, most: int = 3):
    """Every way to cut `text` into at most `most` pieces, and into single characters."""
    yield [text]
    for n in range(1, most):
        for points in itertools.combinations(range(1, len(text)), n):
            bounds = (0, *points, len(text))
            yield [text[a:b] for a, b in itertools.pairwise(bounds)]
    yield list(text)


def streamed(splitter: ThoughtSplitter, pieces: list[str]) -> tuple[list[str], list[str]]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return reasoning + [r], content + [c]


def check_splitter(make, raw: str, opened: bool, want_reasoning: str | None, want_content: str) -> None:
    for pieces in cuts(raw):
        s = make(THINK, opened)
        reasoning, content = streamed(s, pieces)
        assert ("".join(reasoning) if s.thought else None, "".join(content)) == (want_reasoning, want_content), pieces
        # Content never holds the opening of a thought, reasoning never the closing tag or a piece of it sent
        # before the tag was whole.
        if want_reasoning is not None:
            assert THINK.close not in "".join(reasoning)
        # The raw answer reassembles exactly.
        head = THINK.open if s.thought and not opened else ""
        tail = THINK.close if s.thought_end is not None else ""
        assert head + "".join(reasoning) + tail + "".join(content) == raw, pieces


@pytest.mark.parametrize("raw,opened,want_reasoning,want_content", CASES)
def test_every_cut_splits_as_the_whole(raw, opened, want_reasoning, want_content):
    check_splitter(ThoughtSplitter, raw, opened, want_reasoning, want_content)
    reasoning, content, _ = ReasoningParser(THINK, opened).split(raw)
    assert (reasoning, content) == (want_reasoning, want_content)


def test_a_tag_split_across_pieces_is_held_back_until_it_is_whole():
    s = ThoughtSplitter(THINK, opened=False)
    assert s.push("<th") == ("", "")
    assert s.push("ink>ab</") == ("ab", "")  # "</" may begin the closing tag: held
    assert s.push("thi") == ("", "")
    assert s.push("nk>\n") == ("", "\n")
    assert s.thought_end == len("<think>ab</think>")
    assert s.push("<think>") == ("", "<think>")  # after the thought every tag is content


class LeakyTail(ThoughtSplitter):
    """Sends a thought's text as it comes, a possible closing tag's beginning included."""

    def push(self, piece):
        if self.state != "thought":
            return super().push(piece)
        self.length += len(piece)
        text, self.held = self.held + piece, ""
        at = text.find(self.tags.close)
        if at < 0:
            return text, ""
        self.thought_end, self.state = self.length - len(text) + at + len(self.tags.close), "answer"
        return text[:at], text[at + len(self.tags.close):]


class DropsHeld(ThoughtSplitter):
    """Forgets what it held back when the answer ends."""

    def finish(self):
        super().finish()
        return "", ""


class EagerOpen(ThoughtSplitter):
    """Takes a text that begins like the opening tag for content, right away."""

    def push(self, piece):
        if self.state == "start" and not piece.startswith(self.tags.open):
            self.state = "answer"
        return super().push(piece)


@pytest.mark.parametrize("mutant", [LeakyTail, DropsHeld, EagerOpen])
def test_broken_splitters_are_caught(mutant):
    caught = 0
    for raw, opened, want_reasoning, want_content in CASES:
        try:
            check_splitter(mutant, raw, opened, want_reasoning, want_content)
        except AssertionError:
            caught += 1
    assert caught, f"{mutant.__name__} passed every case"


def test_auto_turns_on_where_the_model_has_the_tags():
    assert reasoning_tags("auto", {"<think>": 5, "</think>": 6}, None) == THINK
    assert reasoning_tags("auto", {"<think>": 5}, "{{ messages }}") is None
    assert reasoning_tags("auto", {}, "{{ '<think>\\n' }}...{{ content.split('</think>')[-1] }}") == THINK
    assert reasoning_tags("none", {"<think>": 5, "</think>": 6}, None) is None
    assert reasoning_tags("think", {}, None) == THINK
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek'"):
        reasoning_tags("deepseek", {}, None)


def test_a_prompt_opens_the_thought_where_it_ends_in_the_opening_tag():
    assert opens_thought(THINK, "<|im_start|>assistant\n<think>\n")
    assert not opens_thought(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking off
    assert not opens_thought(THINK, "<|im_start|>assistant\n")


def test_reasoning_tokens_count_the_tokens_that_wrote_the_thought():
    pieces = ["<think>", "a", "b", "</", "think>", "c", "d"]  # token i writes pieces[i]

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    _, _, end = ReasoningParser(THINK, False).split(decode(ids))
    assert reasoning_tokens(ids, end, decode) == 5
    assert reasoning_tokens(ids, 0, decode) == 0
    _, _, end = ReasoningParser(THINK, False).split(decode(ids[:3]))  # never closed: all of it
    assert reasoning_tokens(ids[:3], end, decode) == 3
