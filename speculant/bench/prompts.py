"""Prompt sets for benchmarks: the shipped classes (code, chat, rewrite) or the user's JSONL.

A JSONL row holds one of "prompt" (text), "messages" (a chat) or "prompt_token_ids", and
optionally "id" and "class". A model without a tokenizer (the tiny random models of the tests)
still gets prompts: the UTF-8 bytes of the text, each taken modulo the vocabulary size, so every
configuration sees the same ids and copy-heavy texts stay copy-heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from speculant.errors import SpeculantError
from speculant.models.tokenizer import Tokenizer

PROMPT_CLASSES = ("code", "chat", "rewrite")
PROMPTS_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"


@dataclass
class BenchPrompt:
    id: str
    prompt_class: str
    token_ids: list[int]
    text: str | None = None


def read_jsonl(path: Path, default_class: str) -> list[dict]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SpeculantError(f"cannot read prompts from {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpeculantError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not ({"prompt", "messages", "prompt_token_ids"} & row.keys()):
            raise SpeculantError(f"{path}:{n}: a row needs \"prompt\", \"messages\" or \"prompt_token_ids\"")
        row.setdefault("class", default_class)
        row.setdefault("id", f"{row['class']}-{len(rows)}")
        rows.append(row)
    return rows


def byte_ids(text: str, vocab_size: int) -> list[int]:
    """Token ids for a model without a tokenizer: the text's bytes modulo the vocabulary."""
    return [b % vocab_size for b in text.encode()]


def encode_row(row: dict, tokenizer: Tokenizer | None, vocab_size: int,
               chat: bool) -> tuple[list[int], str | None]:
    if "prompt_token_ids" in row:
        return [int(t) for t in row["prompt_token_ids"]], None
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    text = "\n".join(m["content"] for m in messages)
    if tokenizer is None:
        return byte_ids(text, vocab_size), text
    if chat and tokenizer.chat_template:
        return tokenizer.encode_chat(messages), text
    return tokenizer.encode(text), text


def load_prompts(sources: list[str], tokenizer: Tokenizer | None, vocab_size: int, chat: bool = True,
                 per_class: int | None = None, max_prompt_tokens: int | None = None) -> list[BenchPrompt]:
    """Prompts from shipped class names and/or JSONL paths, at most `per_class` of each class,
    interleaved by class (code, chat, rewrite, code, …) so a truncated run still covers all."""
    rows: list[dict] = []
    for source in sources:
        if source in PROMPT_CLASSES:
            rows += read_jsonl(PROMPTS_DIR / f"{source}.jsonl", source)
        else:
            path = Path(source).expanduser()
            if not path.exists():
                raise SpeculantError(f"prompts: {source!r} is neither a shipped class "
                                     f"({', '.join(PROMPT_CLASSES)}) nor a file")
            rows += read_jsonl(path, path.stem)
    by_class: dict[str, list[BenchPrompt]] = {}
    for row in rows:
        ids, text = encode_row(row, tokenizer, vocab_size, chat)
        if max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]
        if not ids:
            raise SpeculantError(f"prompt {row['id']} is empty")
        group = by_class.setdefault(row["class"], [])
        if per_class is None or len(group) < per_class:
            group.append(BenchPrompt(str(row["id"]), row["class"], ids, text))
    groups = list(by_class.values())
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]
