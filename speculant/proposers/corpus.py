"""Drafts from a corpus of the target's own writing, as REST (He et al., 2024) and SuffixDecoding draft
from a datastore: after the sequence's last 3 (else 2) tokens, the token the target most often wrote
next in the corpus, chained up to k tokens. No model pass: a dictionary lookup per draft.

Prompt lookup finds what the prompt or the answer so far repeats; a small model's answers also repeat
each other — code idioms, the phrases of its explanations and greetings — which the prompt does not
hold. The table keeps a context only where its likeliest next token was seen at least MIN_COUNT times
and in at least MIN_SHARE of the context's occurrences.

A table is built for one tokenizer: its file names the vocabulary (size and digest), and loading it
for another target is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from speculant.errors import SpeculantError
from speculant.models.loader import LoadedModel

FILE = "corpus.safetensors"
# Adaptive k's bucket of a corpus draft: CORPUS_BUCKET + the context length its first draft matched (prompt
# lookup's buckets are its match lengths, 1 to 6; a model's drafts are bucket 0).
CORPUS_BUCKET = 10
MIN_CONTEXT = 2
MAX_CONTEXT = 3  # longer contexts drafted no better in simulation, for a table 2-3x the size
MIN_COUNT = 3
MIN_SHARE = 0.2


def vocab_digest(target: LoadedModel) -> str | None:
    """What identifies the target's vocabulary beyond its size (None without a tokenizer)."""
    if target.tokenizer is None:
        return None
    return hashlib.sha256(json.dumps(sorted(target.tokenizer.vocab.items())).encode()).hexdigest()[:16]


@dataclass
class CorpusTable:
    next_token: dict[int, dict[tuple[int, ...], int]]  # context length → (its last tokens → next token)
    info: dict  # vocab_size, vocab_digest, how the table was built

    def __post_init__(self):
        self.longest_first = sorted(self.next_token, reverse=True)  # the context lengths a draft tries

    @classmethod
    def build(cls, sequences: Iterable[list[int]], target: LoadedModel, max_context: int = MAX_CONTEXT,
              min_count: int = MIN_COUNT, min_share: float = MIN_SHARE) -> CorpusTable:
        counts: dict[int, defaultdict[tuple[int, ...], Counter]] = {
            n: defaultdict(Counter) for n in range(MIN_CONTEXT, max_context + 1)}
        n_tokens = n_sequences = 0
        for seq in sequences:
            n_tokens, n_sequences = n_tokens + len(seq), n_sequences + 1
            for i in range(MIN_CONTEXT, len(seq)):
                for n in range(MIN_CONTEXT, min(max_context, i) + 1):
                    counts[n][tuple(seq[i - n:i])][seq[i]] += 1
        table = {}
        for n, contexts in counts.items():
            table[n] = {}
            for context, following in contexts.items():
                token, count = following.most_common(1)[0]
                if count >= min_count and count >= min_share * following.total():
                    table[n][context] = token
        info = {"vocab_size": target.config.vocab_size, "vocab_digest": vocab_digest(target),
                "tokens": n_tokens, "sequences": n_sequences, "max_context": max_context,
                "min_count": min_count, "min_share": min_share}
        return cls(table, info)

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k drafts after `tokens`, each from the longest context the table holds, and the context
        length the first one matched (([], 0) when none does)."""
        context = list(tokens[-self.longest_first[0]:]) if self.longest_first else []
        drafts, first = [], 0
        while len(drafts) < k:
            for n in self.longest_first:
                token = self.next_token[n].get(tuple(context[-n:])) if len(context) >= n else None
                if token is not None:
                    break
            else:
                break
            first = first or n
            drafts.append(token)
            context.append(token)
        return drafts, first

    def save(self, path: Path) -> None:
        tensors = {}
        for n, contexts in self.next_token.items():
            tensors[f"contexts.{n}"] = torch.tensor(list(contexts), dtype=torch.int32).view(-1, n)
            tensors[f"next.{n}"] = torch.tensor(list(contexts.values()), dtype=torch.int32)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"info": json.dumps(self.info)})

    @property
    def entries(self) -> int:
        return sum(map(len, self.next_token.values()))


def load_corpus(path: str | Path, target: LoadedModel) -> CorpusTable:
    """A table file (or a folder holding corpus.safetensors), checked against the target's vocabulary."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise SpeculantError(f"{path}: no corpus table (build one with `speculant train-draft --kind corpus`)")
    try:
        with safe_open(str(path), "pt") as f:
            info = json.loads((f.metadata() or {})["info"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # not safetensors, or no metadata: either way not a table
        raise SpeculantError(f"{path}: not a corpus table ({type(e).__name__}: {e})") from None
    vocab, digest = target.config.vocab_size, vocab_digest(target)
    if info.get("vocab_size") != vocab or (digest and info.get("vocab_digest") not in (None, digest)):
        raise SpeculantError(f"{path}: this corpus table was built for another vocabulary (size "
                             f"{info.get('vocab_size')}) than the target's ({vocab}); build one for it with "
                             "`speculant train-draft --kind corpus`")
    table = {}
    for name, contexts in tensors.items():
        if name.startswith("contexts."):
            n = int(name.split(".")[1])
            following = tensors[f"next.{n}"]
            if len(contexts) and (int(contexts.max()) >= vocab or int(following.max()) >= vocab):
                raise SpeculantError(f"{path}: token ids beyond the target's vocabulary ({vocab})")
            table[n] = dict(zip(map(tuple, contexts.tolist()), following.tolist()))
    return CorpusTable(table, info)
