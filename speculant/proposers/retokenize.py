"""Text between two tokenizers: the target's verified tokens re-encoded for a draft of another vocabulary,
incrementally, and a draft's text re-encoded as target tokens (string-level drafting).

Both sides are read as bytes, so token boundaries that do not line up and a character split across tokens are
only bytes waiting: a run that is not UTF-8 (half a character) goes to the draft as its single-byte tokens. Text
is re-encoded from an anchor, a byte offset before a space where the draft's tokens end: a pre-tokenizer splits
there, so the tokens before it never change as text is added after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer as HFTokenizer

from speculant.proposers.vocab_map import token_bytes, tokenizer_kind

# Text without a space this long is anchored at a token boundary anyway, so re-encoding stays short (Chinese).
LONG_RUN = 256
UNANCHORED = 4  # tokens left after such an anchor


def utf8_runs(data: bytes) -> list[tuple[bool, bytes]]:
    """data as runs of valid UTF-8 (True) and of bytes that are not (False: half a character, a stray byte)."""
    runs: list[tuple[bool, bytes]] = []
    while data:
        try:
            data.decode()
            runs.append((True, data))
            break
        except UnicodeDecodeError as e:
            if e.start:
                runs.append((True, data[:e.start]))
            runs.append((False, data[e.start:e.end]))
            data = data[e.end:]
    return runs


class TextCodec:
    """One tokenizer read as bytes: each id's bytes, its special tokens, and encoding of bytes that may start
    mid-text."""

    def __init__(self, hf: HFTokenizer):
        self.kind = tokenizer_kind(hf)
        self.bytes, self.special = token_bytes(hf, self.kind)
        # Special tokens are mapped by the caller: text that reads like one is text here.
        self.hf = HFTokenizer.from_str(hf.to_str())
        self.hf.encode_special_tokens = True
        self.byte_id: dict[int, int] = {}
        for i, b in enumerate(self.bytes):
            if b is not None and len(b) == 1 and i not in self.special:
                self.byte_id.setdefault(b[0], i)
        self.by_content = {self.bytes[i].decode(errors="replace"): i for i in self.special}
        # SentencePiece's dummy prefix: each encode starts with a space the text does not have.
        self.prepends = self.text_of(self._encode("a")).startswith(b" ")

    def piece(self, i: int) -> bytes:
        """Token i's bytes; none for an id past the tokenizer's (a model's padding rows)."""
        return (self.bytes[i] if i < len(self.bytes) else None) or b""

    def text_of(self, ids: list[int]) -> bytes:
        return b"".join(self.piece(i) for i in ids)

    def _encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode(self, data: bytes, start: bool) -> list[int]:
        """Tokens for `data`, text that starts the sequence (or follows a special token) where `start`."""
        ids: list[int] = []
        for valid, run in utf8_runs(data):
            if not valid:
                ids += [self.byte_id[b] for b in run if b in self.byte_id]
                continue
            text = run.decode()
            if self.prepends and not (start and not ids):
                if text.startswith(" "):
                    text = text[1:]  # the dummy prefix is this space
                else:
                    ids += self._encode_without_prefix(text)
                    continue
            ids += self._encode(text)
        return ids

    def _encode_without_prefix(self, text: str) -> list[int]:
        ids = self._encode(text)
        if ids and self.piece(ids[0]) == b" ":
            return ids[1:]
        return [t.id for t in self.hf.model.tokenize(text.replace(" ", "\u2581"))]

    def anchor(self, tokens: list[int], data: bytes) -> tuple[int, int]:
        """The longest prefix of `tokens` (the encoding of `data`) that stays when text is added: it ends
        before a space in data, or far into a run without one → (tokens, bytes) it holds (0, 0: none)."""
        best, at = (0, 0), 0
        for j, t in enumerate(tokens[:-1]):
            piece = self.piece(t)
            if data[at:at + len(piece)] != piece:
                break  # a normalizer changed the text: no boundary past here is known
            at += len(piece)
            if data[at:at + 1] == b" ":
                best = (j + 1, at)
            elif (at - best[1] > LONG_RUN and j + 1 <= len(tokens) - UNANCHORED and not self.prepends
                  and at < len(data) and data[at] & 0xC0 != 0x80):
                best = (j + 1, at)
        return best


@dataclass
class DraftText:
    """A sequence as its draft holds it: the draft tokens of the target's text up to an anchor (`stable`), the
    target's bytes after it (`pending`), and the draft tokens its cache holds (`held`: the text's, then guesses)."""

    seen: int = 0  # target tokens read
    stable: list[int] = field(default_factory=list)
    pending: bytes = b""
    start: bool = True  # pending starts the text or follows a special token
    held: list[int] = field(default_factory=list)
    checked: int = 0  # held[:checked] == stable[:checked]


class TextBridge:
    """The target's tokens → the draft's (sync), the draft's → the target's (target_tokens)."""

    def __init__(self, target: TextCodec, draft: TextCodec):
        self.target, self.draft = target, draft
        # A special token of one means the other's special token of the same content.
        self.to_draft = {t: draft.by_content.get(target.bytes[t].decode(errors="replace")) for t in target.special}
        self.to_target = {d: target.by_content.get(draft.bytes[d].decode(errors="replace")) for d in draft.special}

    def sync(self, state: DraftText, tokens: list[int]) -> tuple[int, list[int]]:
        """Read the target's new tokens → (how many of `held` still hold, the draft tokens to feed after
        them); held is updated to what the cache will hold. At least one token is fed: its pass gives the
        next draft."""
        for t in tokens[state.seen:]:
            if t in self.to_draft:
                state.stable += self.draft.encode(state.pending, state.start)
                state.pending, state.start = b"", True
                if self.to_draft[t] is not None:
                    state.stable.append(self.to_draft[t])
            else:
                state.pending += self.target.piece(t)
        state.seen = len(tokens)
        tail = self.draft.encode(state.pending, state.start)
        n, nbytes = self.draft.anchor(tail, state.pending)
        if n:
            state.stable += tail[:n]
            state.pending, state.start, tail = state.pending[nbytes:], False, tail[n:]
        if not state.stable and not tail:
            return 0, []  # no text the draft can read yet
        lo = min(state.checked, len(state.held))
        wanted = state.stable[lo:] + tail
        keep = lo
        for a, b in zip(state.held[lo:], wanted):
            if a != b:
                break
            keep += 1
        keep = min(keep, lo + len(wanted) - 1)
        feed = wanted[keep - lo:]
        del state.held[keep:]
        state.held += feed
        state.checked = len(state.stable)
        return keep, feed

    def target_tokens(self, tokens: list[int], drafted: list[int]) -> list[int]:
        """The draft's tokens `drafted` (continuing the target's `tokens`) as target tokens: its text, up to a
        special token, encoded after the target's last word so that it joins the text as the target's own
        tokenizer would join it."""
        text, special = b"", None
        for d in drafted:
            if d in self.to_target:
                special = self.to_target[d]
                break
            text += self.draft.piece(d)
        tail: list[int] = []
        for t in reversed(tokens[-8:]):
            if t in self.target.special:
                break
            tail.insert(0, t)
            if self.target.piece(t).startswith(b" "):
                break
        ids = self.target.encode(self.target.text_of(tail) + text, start=len(tail) == len(tokens))
        if tail and ids[:len(tail)] == tail:
            ids = ids[len(tail):]
        else:
            ids = self.target.encode(text, start=False)
        if special is not None and self.target.text_of(ids) == text:
            ids.append(special)
        return ids
