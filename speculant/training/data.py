"""Self-distillation data for a draft, made on this machine without a hub.

Two pools come from material every Python install has: the standard library's source (code and
its docstrings) and the long descriptions of installed packages. The target reads texts from the
pools (teacher forcing) and writes answers to prompts built from them (with its chat template).
For every token we record what a draft learns from: the token, the target's top-k log-probabilities
for the next token, and the target's last hidden state (after the final norm: what lm_head reads).

The data set is a folder of numbered safetensors shards plus manifest.json (size and make-up).
Items are a deterministic function of the settings and seed, and a shard file appears only once
complete, so an interrupted run resumes by skipping the shards already there.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from speculant.config import SamplingParams
from speculant.models.loader import LoadedModel

SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "ensurepip"}
MANIFEST = "manifest.json"
_KINDS = ["code", "prose", "chat:complete", "chat:explain", "chat:write", "chat:rewrite", "chat:chat"]


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
    """Teacher-forced texts (about n_text_chars characters), then n_prompts chat prompts, drawn
    with `seed`. Half of the text is stdlib code, half package prose; prompts mix five tasks."""
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
    descriptions = package_descriptions()
    prose = [p for _, text in descriptions for p in paragraphs(text)]
    rng.shuffle(code_chunks)
    rng.shuffle(functions)
    rng.shuffle(prose)

    items = _take(code_chunks, n_text_chars // 2, "code") + _take(prose, n_text_chars // 2, "prose")
    tasks = [
        ("complete", lambda f, d: "Complete this Python code:\n```python\n" + _head(f[0]) + "\n```"),
        ("explain", lambda f, d: "Explain what this function does:\n```python\n" + f[0] + "\n```"),
        ("write", lambda f, d: f"Write a Python function that does this: {first_sentence(f[1])}."),
        ("rewrite", lambda f, d: rewrite_prompt(d, rng)),
        ("chat", lambda f, d: f"In two or three sentences, what is this about?\n\n{d}"),
    ]
    functions = [f for f in functions if len(f[0]) < 1500]  # prompts stay short: answers matter more
    questions = general_questions(rng)
    for i in range(n_prompts):
        task, make = tasks[i % len(tasks)]
        if task == "chat" and i // len(tasks) % 2:  # half the chat prompts: everyday questions
            text = questions[i // (2 * len(tasks)) % len(questions)]
        else:
            text = make(functions[i % len(functions)], prose[-1 - i % len(prose)])
        items.append(Item(f"chat:{task}", text))
    return items


# Everyday questions for the chat share of the prompts: what users ask an assistant, which
# neither the stdlib nor package descriptions contain. The bench's chat prompts (sleep, the sky's
# colour, viruses, guitar, cats, meetings, hiking) are left out so the bench measures held-out text.
TOPICS = (
    "learning a new language", "saving money", "growing tomatoes", "running a marathon", "baking bread",
    "writing a resume", "public speaking", "keeping a journal", "training a puppy", "painting with watercolors",
    "starting a small business", "planning a wedding", "cleaning a kitchen", "learning to swim",
    "volcanoes", "the water cycle", "black holes", "the French Revolution", "electric cars", "solar panels",
    "recycling plastic", "the human heart", "honey bees", "earthquakes", "the moon's phases", "rainbows",
    "compound interest", "climate change", "the printing press", "vaccines", "coffee", "chess", "yoga",
    "meditation", "time management", "remote work", "job interviews", "first aid", "camping in the desert",
    "moving to a new city", "choosing a laptop", "password security", "backing up photos", "email etiquette",
    "the Roman Empire", "ancient Egypt", "the Olympic Games", "jazz music", "photography", "birdwatching",
    "composting", "houseplants", "cooking rice", "making pasta", "healthy breakfasts", "drinking water",
    "stretching", "cycling to work", "learning to code", "databases", "the internet", "machine learning",
    "spreadsheets", "3D printing", "the stock market", "renting an apartment", "buying a used car",
    "negotiating a salary", "writing a cover letter", "studying for exams", "reading more books",
    "teaching children to read", "board games", "tea", "chocolate", "sharks", "elephants", "dolphins",
    "penguins", "rainforests", "deserts", "glaciers", "tides", "gravity", "magnets", "electricity",
    "the speed of light", "DNA", "the immune system", "antibiotics", "nutrition labels", "fermentation",
    "bicycles", "airplanes", "trains", "bridges", "skyscrapers", "lighthouses", "maps", "calendars",
)
QUESTION_TEMPLATES = (
    "Tell me about {topic}.",
    "What are the main benefits of {topic}?",
    "How do I get started with {topic}?",
    "Write a short paragraph about {topic}.",
    "Give me three tips about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "What are common mistakes people make with {topic}?",
    "Write a short list of facts about {topic}.",
)


REWRITE_INSTRUCTIONS = (
    "Rewrite this paragraph in simpler words:",
    "Rewrite the following paragraph in a formal tone:",
    "Rewrite the following paragraph in the past tense:",
    "Rewrite this paragraph as a bulleted list of its facts:",
    "Rewrite the following paragraph in plain English for a child:",
    "Rewrite the following paragraph to make it shorter, keeping its meaning:",
)
FIX_INSTRUCTIONS = (
    "Fix the typos in this paragraph and return the corrected paragraph:",
    "Rewrite the following paragraph with correct grammar and spelling, keeping its meaning:",
    "Rewrite the following paragraph with correct punctuation and capital letters:",
)


def rewrite_prompt(paragraph: str, rng: random.Random) -> str:
    """A rewrite request; a third of them ask to fix a paragraph with typos put in on purpose."""
    if rng.random() < 1 / 3:
        return rng.choice(FIX_INSTRUCTIONS) + "\n\n" + add_typos(paragraph, rng)
    return rng.choice(REWRITE_INSTRUCTIONS) + "\n\n" + paragraph


def add_typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """Swap, drop or double a letter in about `rate` of the words; lowercase some sentence starts."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 1)
            words[i] = rng.choice((w[:j] + w[j + 1] + w[j] + w[j + 2:], w[:j] + w[j + 1:], w[:j] + w[j] + w[j:]))
        elif i and words[i - 1].endswith(".") and rng.random() < 0.5:
            words[i] = w.lower()
    return " ".join(words)


def general_questions(rng: random.Random) -> list[str]:
    questions = [t.format(topic=topic) for topic in TOPICS for t in QUESTION_TEMPLATES]
    rng.shuffle(questions)
    return questions


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

    `workers` processes may record one data set together, worker i taking every workers-th shard;
    each writes the manifest of what is there when it finishes (the last one: everything)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    items = build_items(n_text_chars, n_prompts, seed)
    texts = [it for it in items if not it.kind.startswith("chat:")]
    chats = [it for it in items if it.kind.startswith("chat:")]
    # Chat shards hold only prompts, so the target writes their answers as one batch.
    shards = [group[i:i + shard_items] for group in (texts, chats) for i in range(0, len(group), shard_items)]
    for i, shard in enumerate(tqdm(shards, desc="recording", unit="shard")):
        path = out / f"shard-{i:05d}.safetensors"
        if path.exists() or i % workers != worker:
            continue
        seqs = [tokenize(it, target, max_len) for it in shard]
        chats = [j for j, it in enumerate(shard) if it.kind.startswith("chat:")]
        if chats:
            answered = answer([seqs[j] for j in chats], target, answer_tokens, seed + 1000 * i)
            for j, full in zip(chats, answered):
                seqs[j] = full
        data = record(seqs, target, top_k)
        data["kinds"] = torch.tensor([_KINDS.index(it.kind) for it in shard], dtype=torch.int32)
        tmp = path.with_suffix(f".tmp{worker}")
        save_file(data, str(tmp))
        tmp.rename(path)  # a shard exists only once complete: resume never reads half a file
    settings = dict(n_text_chars=n_text_chars, n_prompts=n_prompts, answer_tokens=answer_tokens, top_k=top_k,
                    max_len=max_len, seed=seed)
    manifest = describe(out, target, settings)
    manifest["complete"] = len(list(out.glob("shard-*.safetensors"))) == len(shards)
    manifest["wall_time_s_this_run"] = round(time.perf_counter() - t0, 1)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest



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


def load_dataset(folder: Path) -> dict[str, torch.Tensor]:
    """All shards concatenated: tokens [N], offsets [S+1], hidden [N, D], topk_logprobs/ids [N, K]."""
    shards = [load_file(str(p)) for p in sorted(Path(folder).glob("shard-*.safetensors"))]
    if not shards:
        raise FileNotFoundError(f"{folder}: no recorded shards (run the recording first)")
    offsets, base = [torch.zeros(1, dtype=torch.long)], 0
    for s in shards:
        offsets.append(s["offsets"][1:] + base)
        base += int(s["offsets"][-1])
    joined = {k: torch.cat([s[k] for s in shards]) for k in ("tokens", "hidden", "topk_logprobs", "topk_ids")}
    joined["offsets"] = torch.cat(offsets)
    return joined
