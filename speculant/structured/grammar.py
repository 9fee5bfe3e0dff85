"""Grammars for structured output, compiled by llguidance for the model's tokenizer, and the matcher
state a constrained sequence carries.

A GrammarState is the grammar after a sequence's output so far. The engine asks it for the tokens allowed
next (a mask over the vocabulary), pushes drafts onto it while it drafts or scores them, and rolls those
back before committing what the verifier accepted: the matcher always ends a step at the committed tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy
import torch

from speculant.config import StructuredOutputsParams
from speculant.errors import SpeculantError
from speculant.models.tokenizer import Tokenizer

# The JSON a small model writes unprompted (json.dumps' separators, no free whitespace): a key's quotes,
# colon and the space after it are then forced, so they cost no model pass.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec` (not yet checked)."""
    kind, text = spec.key()
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise SpeculantError("the JSON schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return llguidance.grammar_from("lark" if kind == "grammar" else kind, text)
    except (ValueError, TypeError) as e:
        raise SpeculantError(f"invalid {kind} for structured output: {e}") from None


@dataclass
class CompiledGrammar:
    matcher: llguidance.LLMatcher  # at the grammar's start: each sequence gets a copy
    compile_s: float


class GrammarCompiler:
    """Compiles grammars for one tokenizer, keeping the latest CACHE_SIZE by what they were made from (a
    schema's text): the same schema sent again costs a copy of its matcher."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=eos_ids)
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles in its handler threads, the engine in its own

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar for `spec`; raises SpeculantError naming what is wrong with it."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        t0 = time.perf_counter()
        text = grammar_text(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer)
        if failed:
            raise SpeculantError(f"invalid {key[0]} for structured output: {messages[0]}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise SpeculantError(f"invalid {key[0]} for structured output: {matcher.get_error()}")
        compiled = CompiledGrammar(matcher, time.perf_counter() - t0)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile(spec).matcher.deep_copy(), self.vocab_size)


def free_bitmask(vocab_size: int) -> bytes:
    """Every token allowed, as a bitmask."""
    return b"\xff" * ((vocab_size + 7) // 8)


def unpack(bitmasks: list[bytes], vocab_size: int) -> torch.Tensor:
    """Bitmasks (bit i % 8 of byte i // 8: token i allowed; llguidance's may run a word past the
    vocabulary) → bool [N, vocab_size]. A row where nothing is allowed lies past the answer's end or past
    a draft the grammar forbids (never accepted, never read): it allows everything, rather than become a
    distribution of NaNs."""
    n = (vocab_size + 7) // 8
    packed = numpy.frombuffer(b"".join(m[:n] for m in bitmasks), dtype=numpy.uint8).reshape(len(bitmasks), n)
    # numpy's unpackbits, one vectorized pass on one thread: torch's shifts over a vocabulary cost 10x more.
    bits = numpy.unpackbits(packed, axis=1, count=vocab_size, bitorder="little")
    bits[~packed.any(axis=1)] = 1
    return torch.from_numpy(bits.view(numpy.bool_))


class GrammarState:
    """A sequence's matcher: committed tokens, then the drafts pushed on top of them this step."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.pushed = 0  # drafts on top of the committed tokens
        self.off_grammar = False  # a draft pushed this step was outside the grammar: masks stop there

    def bitmask(self) -> bytes:
        """The tokens allowed next. Past a draft the grammar forbids nothing is reachable: everything is
        allowed there (those drafts are never accepted, so what follows them is never read)."""
        if self.off_grammar:
            return free_bitmask(self.vocab_size)
        return self.matcher.compute_bitmask()

    def allowed(self) -> torch.Tensor:
        return unpack([self.bitmask()], self.vocab_size)[0]

    def push(self, token: int) -> bool:
        """A draft on top of the current state, undone by `settle`; False (and no more masks this step)
        where the grammar forbids it."""
        if self.off_grammar or self.matcher.validate_tokens([token]) != 1:
            self.off_grammar = True
            return False
        self.matcher.consume_token(token)
        self.pushed += 1
        return True

    def settle(self) -> None:
        """Back to the committed tokens."""
        if self.pushed:
            self.matcher.rollback(self.pushed)
        self.pushed, self.off_grammar = 0, False

    def commit(self, token: int) -> None:
        """The sequence's next token (the state must be settled)."""
        if self.matcher.validate_tokens([token]) != 1 or not self.matcher.consume_token(token):
            raise SpeculantError(f"token {token} is outside the request's grammar ({self.matcher.get_error()})")

    @property
    def stopped(self) -> bool:
        """Nothing may follow: the answer is complete."""
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the current state, the grammar allows in a row."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (a key, its quotes and colon), at most `limit`."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def masks_along(self, tokens: list[int], parents: list[int] | None = None) -> list[bytes]:
        """Bitmasks at the current state (0) and after each draft j (j + 1), drafts a chain or a tree
        (`parents`, as Proposal.parents: a draft's parent comes before it)."""
        masks = [self.bitmask()]
        if parents is None:
            for token in tokens:
                self.push(token)
                masks.append(self.bitmask())
            self.settle()
            return masks
        for j in range(len(tokens)):
            path, node = [], j
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            for token in reversed(path):
                self.push(token)
            masks.append(self.bitmask())
            self.settle()
        return masks
