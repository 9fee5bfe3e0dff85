"""Self-distillation data for a draft, made on this machine without a hub.

Two pools come from material every Python install has: the standard library's source (code and
its docstrings) and the long descriptions of installed packages. The target reads texts from the
pools (teacher forcing) and answers requests with its chat template: requests built from the pools,
requests shaped like what users ask (prompts.py), and rewrites of its own answers.
For every token we record what a draft learns from: the token, the target's top-k log-probabilities
for the next token, and the target's last hidden state (after the final norm: what lm_head reads).

The data set is a folder of numbered safetensors shards plus manifest.json (size and make-up).
Items are a deterministic function of the settings, the seed and the answers already recorded, and a
shard file appears only once complete, so an interrupted run resumes by skipping the shards already there.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import random
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from speculant.config import SamplingParams
from speculant.errors import SpeculantError
from speculant.models.loader import LoadedModel
from speculant.training import prompts

SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "ensurepip"}
MANIFEST = "manifest.json"
_KINDS = ["code", "prose", "chat:complete", "chat:explain", "chat:write", "chat:rewrite", "chat:chat", "chat:code",
          "chat:question", "chat:writing"]


@dataclass
class Item:
    kind: str  # "code", "prose" (teacher-forced text) or "chat:<task>" (a prompt the target answers)
    text: str


# -- pools --------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not SKIPPED_STDLIB_DIRS & set(p.relative_to(root).parts[:-1]))


def documented_functions(source: str) -> list[tuple[str, str]]:
    """(source, docstring) of each top-level or method function that has a docstring."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            code = ast.get_source_segment(source, node)
            if doc and code and 200 < len(code) < 2500:
                out.append((code, doc))
    return out


def package_descriptions() -> list[tuple[str, str]]:
    """(name, long description) of installed distributions, deduplicated by name."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") or ""
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if name and len(text) > 300 and name.lower() not in seen:
            seen[name.lower()] = text
    return sorted(seen.items())


def paragraphs(text: str, min_chars: int = 150, max_chars: int = 1200) -> list[str]:
    paras = [p.strip() for p in text.split("\n\n")]
    return [p for p in paras if min_chars <= len(p) <= max_chars and not p.startswith(("..", "|", "<", "[!"))]


def first_sentence(doc: str) -> str:
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return line.split(". ")[0].rstrip(".")


def build_items(n_text_chars: int, n_prompts: int, seed: int = 0) -> list[Item]:
    """Teacher-forced texts (about n_text_chars characters), then n_prompts requests for the target
    to answer, drawn with `seed`. Half of the text is stdlib code, half package prose. The requests
    (prompts.py): a quarter code in several languages, a quarter everyday questions, a fifth short
    pieces of writing (whose answers are rewritten later: rewrite_items), the rest Python functions of
    the standard library to complete, explain or write, and package paragraphs to sum up."""
    rng = random.Random(seed)
    files = stdlib_files()
    rng.shuffle(files)
    code_chunks, functions = [], []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        functions += documented_functions(source)
        lines = source.splitlines(keepends=True)
        for i in range(0, len(lines), 60):
            chunk = "".join(lines[i:i + 60])
            if len(chunk) > 400:
                code_chunks.append(chunk)
        if len(functions) > 4 * n_prompts and sum(map(len, code_chunks)) > n_text_chars:
            break
    prose = [p for _, text in package_descriptions() for p in paragraphs(text)]
    rng.shuffle(code_chunks)
    rng.shuffle(functions)
    rng.shuffle(prose)

    items = _take(code_chunks, n_text_chars // 2, "code") + _take(prose, n_text_chars // 2, "prose")
    functions = [f for f in functions if len(f[0]) < 1500]  # prompts stay short: answers matter more
    tasks = {  # kind: (share, request for the i-th prompt)
        "code": (0.25, lambda i: prompts.code_request(rng)),
        "question": (0.25, lambda i: prompts.everyday_question(rng)),
        "writing": (0.2, lambda i: prompts.writing_request(rng)),
        "complete": (0.08, lambda i: "Complete this Python code:\n```python\n" + _head(functions[i][0]) + "\n```"),
        "explain": (0.08, lambda i: "Explain what this function does:\n```python\n" + functions[i][0] + "\n```"),
        "write": (0.08, lambda i: f"Write a Python function that does this: {first_sentence(functions[i][1])}."),
        "chat": (0.06, lambda i: f"In two or three sentences, what is this about?\n\n{prose[i % len(prose)]}"),
    }
    kinds = rng.choices(list(tasks), weights=[share for share, _ in tasks.values()], k=n_prompts)
    for i, kind in enumerate(kinds):
        items.append(Item(f"chat:{kind}", tasks[kind][1](i % len(functions))))
    return items


def rewrite_items(written: list[str], seed: int) -> list[Item]:
    """A rewrite request for each answer to a writing request (`written`) on its longest paragraph:
    everyday prose, which users ask to have rewritten and package descriptions are not."""
    rng = random.Random(seed)
    return [Item("chat:rewrite", prompts.rewrite_request(p, rng))
            for p in map(prompts.answer_paragraph, written) if p]


def _take(texts: list[str], n_chars: int, kind: str) -> list[Item]:
    out, total = [], 0
    for t in texts:
        if total >= n_chars:
            break
        out.append(Item(kind, t))
        total += len(t)
    return out


def _head(code: str) -> str:
    lines = code.splitlines()
    return "\n".join(lines[:max(2, len(lines) // 3)])


# -- recording ----------------------------------------------------------------------------------


@torch.inference_mode()
def record(tokens: list[list[int]], target: LoadedModel, top_k: int) -> dict[str, torch.Tensor]:
    """Teacher-force each sequence through the target and keep, per token: the hidden state after
    the final norm (bf16) and the top-k next-token log-probabilities (fp16) with their ids."""
    model = target.model
    hidden, logprobs, ids = [], [], []
    for seq in tokens:
        cache = model.new_cache(1, len(seq))
        h = model(torch.tensor([seq], device=model.device), cache, torch.tensor([0], device=model.device))[0]
        lp = torch.log_softmax(model.logits(h), dim=-1).topk(top_k, dim=-1)
        hidden.append(h.to(torch.bfloat16))
        logprobs.append(lp.values.half())
        ids.append(lp.indices.int())
    lengths = torch.tensor([len(s) for s in tokens])
    return {
        "tokens": torch.tensor([t for s in tokens for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "hidden": torch.cat(hidden).cpu(),
        "topk_logprobs": torch.cat(logprobs).cpu(),
        "topk_ids": torch.cat(ids).cpu(),
    }


def answer(prompts: list[list[int]], target: LoadedModel, max_tokens: int, seed: int) -> list[list[int]]:
    """The target's own answers (greedy for even items, temperature 0.7 for odd ones), as full
    sequences prompt + answer."""
    from speculant.engine import Engine

    longest = max(map(len, prompts)) + max_tokens + 1
    engine = Engine(target, max_batch_size=len(prompts), max_model_len=longest)
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7, seed=seed + i,
                                                 max_tokens=max_tokens))
            for i, p in enumerate(prompts)]
    engine.generate(seqs)
    return [s.tokens for s in seqs]


def tokenize(item: Item, target: LoadedModel, max_len: int) -> list[int]:
    tok = target.tokenizer
    if item.kind.startswith("chat:"):
        return tok.encode_chat([{"role": "user", "content": item.text}])  # whole: the template ends it
    return tok.encode(item.text)[:max_len]


def build_dataset(target: LoadedModel, out: Path, n_text_chars: int = 600_000, n_prompts: int = 160,
                  answer_tokens: int = 160, top_k: int = 32, max_len: int = 512, shard_items: int = 16,
                  seed: int = 0, worker: int = 0, workers: int = 1) -> dict:
    """Record the data set into `out`, skipping the shards already complete; returns the manifest.

    Two phases: the texts and requests of build_items, then a rewrite request for each answer the
    target wrote to a writing request (rewrite_items), once every first-phase shard is there.
    `workers` processes may record one data set together, worker i taking every workers-th shard;
    each writes the manifest of what is there when it finishes (the last one: everything)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    items = build_items(n_text_chars, n_prompts, seed)
    first = in_shards(items, shard_items)
    record_shards = functools.partial(_record_shards, target=target, out=out, answer_tokens=answer_tokens,
                                      top_k=top_k, max_len=max_len, seed=seed)
    record_shards(first, 0, lambda i: i % workers == worker)
    n_shards = None  # known once every first-phase shard is there
    if all((out / _shard_name(i)).exists() for i in range(len(first))):
        second = in_shards(rewrite_items(written_answers(out, first, target, max_len), seed + 1), shard_items)
        # Whichever worker finds the first phase complete records all the rewrites: the others are done.
        record_shards(second, len(first), lambda i: True)
        n_shards = len(first) + len(second)
    settings = dict(n_text_chars=n_text_chars, n_prompts=n_prompts, answer_tokens=answer_tokens, top_k=top_k,
                    max_len=max_len, seed=seed)
    manifest = describe(out, target, settings)
    manifest["complete"] = len(list(out.glob("shard-*.safetensors"))) == n_shards
    manifest["wall_time_s_this_run"] = round(time.perf_counter() - t0, 1)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def in_shards(items: list[Item], shard_items: int) -> list[list[Item]]:
    """Items in shards, texts apart from chats: chat shards hold only prompts, so the target writes
    their answers as one batch."""
    texts = [it for it in items if not it.kind.startswith("chat:")]
    chats = [it for it in items if it.kind.startswith("chat:")]
    return [group[i:i + shard_items] for group in (texts, chats) for i in range(0, len(group), shard_items)]


def _record_shards(shards: list[list[Item]], first_index: int, mine: Callable[[int], bool], target: LoadedModel,
                   out: Path, answer_tokens: int, top_k: int, max_len: int, seed: int) -> None:
    """Record the shards numbered from first_index on that are `mine` and not there yet."""
    for n, shard in enumerate(tqdm(shards, desc="recording", unit="shard")):
        i = first_index + n
        path = out / _shard_name(i)
        if path.exists() or not mine(i):
            continue
        seqs = [tokenize(it, target, max_len) for it in shard]
        chats = [j for j, it in enumerate(shard) if it.kind.startswith("chat:")]
        if chats:
            answered = answer([seqs[j] for j in chats], target, answer_tokens, seed + 1000 * i)
            for j, full in zip(chats, answered):
                seqs[j] = full
        data = record(seqs, target, top_k)
        data["kinds"] = torch.tensor([_KINDS.index(it.kind) for it in shard], dtype=torch.int32)
        _save_shard(data, path)


def _save_shard(data: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(data, str(tmp))
    tmp.rename(path)  # a shard exists only once complete: resume never reads half a file


def _sequences(tokens: torch.Tensor, offsets: torch.Tensor) -> list[list[int]]:
    """A shard's sequences from its tokens [N] and offsets [S+1]."""
    tokens, offsets = tokens.tolist(), offsets.tolist()
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def written_answers(out: Path, shards: list[list[Item]], target: LoadedModel, max_len: int) -> list[str]:
    """The target's answers to the writing requests among `shards` (recorded in `out`), as text."""
    answers = []
    for i, shard in enumerate(shards):
        if not any(it.kind == "chat:writing" for it in shard):
            continue
        data = load_file(str(out / _shard_name(i)))
        tokens, offsets = data["tokens"].tolist(), data["offsets"].tolist()
        for j, it in enumerate(shard):
            if it.kind == "chat:writing":
                prompt = len(tokenize(it, target, max_len))
                answers.append(target.tokenizer.decode(tokens[offsets[j] + prompt:offsets[j + 1]]))
    return answers


def describe(folder: Path, target: LoadedModel, settings: dict) -> dict:
    """Size and make-up of the recorded data set."""
    make_up: dict[str, dict[str, int]] = {}
    for path in sorted(folder.glob("shard-*.safetensors")):
        shard = load_file(str(path))
        lengths = (shard["offsets"][1:] - shard["offsets"][:-1]).tolist()
        for kind, n in zip(shard["kinds"].tolist(), lengths):
            entry = make_up.setdefault(_KINDS[kind], {"sequences": 0, "tokens": 0})
            entry["sequences"] += 1
            entry["tokens"] += n
    return {
        "target": target.source,
        "tokens": sum(e["tokens"] for e in make_up.values()),
        "sequences": sum(e["sequences"] for e in make_up.values()),
        "make_up": make_up,
        "settings": settings,
        "recorded": ["tokens", "hidden (final-norm output, bf16)",
                     f"top-{settings['top_k']} log-probs (fp16) + ids"],
    }


def record_answers(target: LoadedModel, out: Path, n_prompts: int = 2400, answer_tokens: int = 160, seed: int = 0,
                   batch_size: int = 32, shard_items: int = 256, max_len: int = 512) -> dict:
    """Only what a corpus table reads: the target's greedy answers (prompt + answer tokens) to build_items'
    requests, then to rewrites of its own pieces of writing, decoded in batches with no features
    recorded. Shards hold tokens, offsets and kinds like build_dataset's; complete shards are kept on
    a rerun. Greedy answers because a greedy request's drafts come true when they are what the target
    writes greedily."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    first = in_shards(build_items(0, n_prompts, seed), shard_items)
    answers = _answer_shards(target, out, first, 0, answer_tokens, batch_size, max_len)
    second = in_shards(rewrite_items(written_answers(out, first, target, max_len), seed + 1), shard_items)
    answers += _answer_shards(target, out, second, len(first), answer_tokens, batch_size, max_len)
    manifest = {"target": target.source, "tokens": sum(map(len, answers)),
                "sequences": len(answers), "recorded": ["tokens (greedy answers)"],
                "settings": dict(n_prompts=n_prompts, answer_tokens=answer_tokens, seed=seed), "complete": True,
                "wall_time_s_this_run": round(time.perf_counter() - t0, 1)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _answer_shards(target: LoadedModel, out: Path, shards: list[list[Item]], first_index: int, answer_tokens: int,
                   batch_size: int, max_len: int) -> list[list[int]]:
    """Every item's prompt + greedy answer, shard by shard (read back where a shard is there already)."""
    from speculant.engine import Engine

    sequences = []
    for n, shard in enumerate(tqdm(shards, desc="answering", unit="shard")):
        path = out / _shard_name(first_index + n)
        if path.exists():
            data = load_file(str(path))
            sequences += _sequences(data["tokens"], data["offsets"])
            continue
        prompts_ = [tokenize(it, target, max_len) for it in shard]
        engine = Engine(target, max_batch_size=batch_size, max_model_len=max(map(len, prompts_)) + answer_tokens + 1)
        seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=answer_tokens)) for p in prompts_]
        engine.generate(seqs)
        lengths = torch.tensor([0] + [len(s.tokens) for s in seqs])
        data = {"tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int32),
                "offsets": lengths.cumsum(0), "kinds": torch.tensor([_KINDS.index(it.kind) for it in shard],
                                                                    dtype=torch.int32)}
        _save_shard(data, path)
        sequences += [s.tokens for s in seqs]
    return sequences


def recorded(folder: Path) -> bool:
    """Whether `folder` holds a complete recording (build_dataset's or record_answers')."""
    try:
        return json.loads((folder / MANIFEST).read_text()).get("complete", False)
    except (OSError, json.JSONDecodeError):
        return False


def load_token_sequences(folders: list[Path]) -> Iterator[list[int]]:
    """Every recorded sequence's tokens, without the features (a corpus table needs the tokens only)."""
    for folder in folders:
        shards = sorted(Path(folder).glob("shard-*.safetensors"))
        if not shards:
            raise SpeculantError(f"{folder}: no recorded shards (run the recording first)")
        for path in shards:
            with safe_open(str(path), "pt") as f:
                yield from _sequences(f.get_tensor("tokens"), f.get_tensor("offsets"))


def load_dataset(folders: Path | list[Path]) -> dict[str, torch.Tensor]:
    """All shards of one or more data folders concatenated: tokens [N], offsets [S+1], hidden [N, D],
    topk_logprobs/ids [N, K]."""
    folders = [folders] if isinstance(folders, (str, Path)) else folders
    shards = []
    for folder in folders:
        found = [load_file(str(p)) for p in sorted(Path(folder).glob("shard-*.safetensors"))]
        if not found:
            raise SpeculantError(f"{folder}: no recorded shards (run the recording first)")
        shards += found
    if any("hidden" not in s for s in shards):
        raise SpeculantError(f"{', '.join(map(str, folders))}: holds tokens only (greedy answers recorded for a "
                             "corpus table); an EAGLE head or a draft model trains on a full recording")
    if len({(s["hidden"].shape[1], s["topk_ids"].shape[1]) for s in shards}) > 1:
        raise SpeculantError(f"{', '.join(map(str, folders))}: recorded from different targets or with different "
                             "--top-k (feature or log-probability widths differ)")
    offsets, base = [torch.zeros(1, dtype=torch.long)], 0
    for s in shards:
        offsets.append(s["offsets"][1:] + base)
        base += int(s["offsets"][-1])
    joined = {k: torch.cat([s[k] for s in shards]) for k in ("tokens", "hidden", "topk_logprobs", "topk_ids")}
    joined["offsets"] = torch.cat(offsets)
    return joined
