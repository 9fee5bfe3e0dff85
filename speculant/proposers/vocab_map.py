"""How a draft's vocabulary meets its target's (Timor et al., ICML 2025): the tokens whose strings both hold
(token-level intersection, TLI) and the share they are of the draft's vocabulary, from which the mapping is chosen.

TLI needs tokenizers of one kind, so that one string is one text in both (byte-level BPE over the same byte
alphabet, SentencePiece with SentencePiece). Between other kinds the share is counted on the tokens' bytes and
only string-level drafting (re-tokenized text, greedy) is offered. The map is built once a pair and kept on disk,
keyed by both tokenizers' hashes.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer as HFTokenizer

from speculant.models.gguf_file import cache_dir

BYTE_LEVEL, SENTENCEPIECE, OTHER = "byte-level BPE", "SentencePiece", "other"
# Below this share of the draft's vocabulary a draft is refused: it was made for other text.
REFUSE_BELOW = 0.05
# From this share TLI drafts for every request; below it greedy requests draft by string level.
TLI_FROM = 0.5
FORMAT_VERSION = 1


def tokenizer_kind(hf: HFTokenizer) -> str:
    """byte-level BPE (a ByteLevel pre-tokenizer or decoder), SentencePiece (▁ for a space, a Metaspace or
    byte fallback), else other."""
    spec = json.loads(hf.to_str())
    parts = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder"), spec.get("normalizer")])
    if '"ByteLevel"' in parts:
        return BYTE_LEVEL
    if '"Metaspace"' in parts or '"ByteFallback"' in parts or "\u2581" in parts or "\\u2581" in parts:
        return SENTENCEPIECE
    return OTHER


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(hf: HFTokenizer, kind: str) -> tuple[list[bytes | None], set[int]]:
    """Each id's text as bytes (None where the id has no token) and the special tokens' ids (their text is
    their content)."""
    vocab = hf.get_vocab(with_added_tokens=True)
    added = hf.get_added_tokens_decoder()
    table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    decoder = byte_decoder()
    for s, i in vocab.items():
        if i in added:
            table[i] = added[i].content.encode()
        elif kind == BYTE_LEVEL and all(c in decoder for c in s):
            table[i] = bytes(decoder[c] for c in s)
        elif kind == SENTENCEPIECE and len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            table[i] = bytes([int(s[3:5], 16)])
        elif kind == SENTENCEPIECE:
            table[i] = s.replace("\u2581", " ").encode()
        else:
            table[i] = s.encode()
    return table, {i for i, t in added.items() if t.special}


@dataclass
class VocabMap:
    """The draft ids TLI may propose and the target id each means, sorted by target id (the order a draw over
    part of the vocabulary reads: Proposer.draw), and the facts the mapping is chosen from."""

    draft_ids: torch.Tensor  # [n] long
    target_ids: torch.Tensor  # [n] long, ascending
    shared: int  # draft tokens whose text the target has as one token (by bytes across kinds)
    draft_size: int
    target_size: int
    draft_kind: str
    target_kind: str

    @property
    def same_kind(self) -> bool:
        return self.draft_kind == self.target_kind and self.draft_kind != OTHER

    @property
    def share(self) -> float:
        return self.shared / max(self.draft_size, 1)

    def mapping(self) -> str:
        """"tli" (every request), "string" (greedy requests; sampled ones by TLI where the kinds match), or
        "refuse"."""
        if self.share < REFUSE_BELOW:
            return "refuse"
        return "tli" if self.same_kind and self.share >= TLI_FROM else "string"

    def summary(self, mapping: str) -> str:
        """The mapping in a report's few words."""
        shared = f"{self.share:.0%} of the draft's vocabulary shared"
        if mapping == "tli":
            return f"TLI, {shared}"
        return f"string level for greedy requests ({'TLI' if self.same_kind else 'none'} for sampled), {shared}"

    def describe(self) -> str:
        """The one line a user reads at load: how the vocabularies map and why."""
        shared = (f"{self.shared:,} of the draft's {self.draft_size:,} tokens ({self.share:.0%}) are the "
                  f"target's too (target: {self.target_size:,})")
        mode = self.mapping()
        if mode == "refuse":
            return (f"the draft shares almost nothing with the target's vocabulary: {shared}; below "
                    f"{REFUSE_BELOW:.0%} it cannot draft for it")
        if mode == "tli":
            return (f"draft and target vocabularies differ ({self.draft_kind} both): drafting by token-level "
                    f"intersection (TLI): {shared}; the draft proposes only those, exact for greedy and sampled")
        why = (f"the tokenizers are of different kinds ({self.draft_kind} vs {self.target_kind})" if not self.same_kind
               else f"the intersection is below {TLI_FROM:.0%} of the draft's vocabulary")
        sampled = "by TLI" if self.same_kind else "without a draft"
        return (f"draft and target vocabularies differ: {shared}; {why}, so greedy requests draft by string "
                f"level (the draft's text re-tokenized by the target's tokenizer, verified by exact match) and "
                f"sampled ones {sampled}")


def tokenizer_hash(hf: HFTokenizer) -> str:
    return hashlib.sha256(hf.to_str().encode()).hexdigest()


def vocab_map(target: HFTokenizer, draft: HFTokenizer, target_rows: int, draft_rows: int,
              use_cache: bool = True) -> VocabMap:
    """The map between two tokenizers, ids below each model's rows (its embedding's size); cached on disk."""
    key = hashlib.sha256(f"{FORMAT_VERSION}|{tokenizer_hash(target)}|{tokenizer_hash(draft)}|{target_rows}|"
                         f"{draft_rows}".encode()).hexdigest()[:24]
    path = cache_dir(None) / "vocab_maps" / f"{key}.pt"
    if use_cache and path.exists():
        try:
            return VocabMap(**torch.load(path, weights_only=True))
        except Exception:
            pass  # a broken file is rebuilt
    built = build_vocab_map(target, draft, target_rows, draft_rows)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(built.__dict__, tmp)
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache: built again next time
    return built


def build_vocab_map(target: HFTokenizer, draft: HFTokenizer, target_rows: int, draft_rows: int) -> VocabMap:
    t_kind, d_kind = tokenizer_kind(target), tokenizer_kind(draft)
    t_vocab = {s: i for s, i in target.get_vocab(with_added_tokens=True).items() if i < target_rows}
    d_vocab = {s: i for s, i in draft.get_vocab(with_added_tokens=True).items() if i < draft_rows}
    pairs: dict[int, int] = {}  # target id → draft id
    if t_kind == d_kind and t_kind != OTHER:
        for s, d in d_vocab.items():
            t = t_vocab.get(s)
            if t is not None:
                pairs.setdefault(t, d)
        shared = len(pairs)
    else:
        t_bytes, _ = token_bytes(target, t_kind)
        d_bytes, _ = token_bytes(draft, d_kind)
        texts = {b for i, b in enumerate(t_bytes) if b and i < target_rows}
        shared = sum(1 for i, b in enumerate(d_bytes) if b and i < draft_rows and b in texts)
    order = sorted(pairs)
    return VocabMap(torch.tensor([pairs[t] for t in order], dtype=torch.long), torch.tensor(order, dtype=torch.long),
                    shared, len(d_vocab), len(t_vocab), d_kind, t_kind)
