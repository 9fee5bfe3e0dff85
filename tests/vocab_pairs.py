"""Tiny model pairs whose tokenizers differ (built with the `tokenizers` library): the drafts of cross_vocab.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from conftest import save_tiny
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: save_tiny's bos 1 and eos 2
CORPUS_A = ["the cat sat on the mat; café au lait, naïve résumé", "def add(a, b):\n    return a + b\n",
            "日本語のテキスト 🙂 emoji ✓", "print('hello world') # the end"] * 20
CORPUS_B = ["zebras quickly jumped over lazy dogs", "SELECT name FROM users WHERE id = 42;",
            "über straße — «quotes» ½", "for i in range(10): total += i"] * 20


def byte_level(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `corpus` (its 256 byte tokens, then merges), SPECIALS first."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def bpe(vocab: dict[str, int], merges: list[tuple[str, str]], byte_level_kind: bool = True) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    if byte_level_kind:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def sibling(tok: Tokenizer, drop: int, new: list[tuple[str, str]], seed: int = 0) -> tuple[Tokenizer, dict[int, int]]:
    """`tok` without its last `drop` merges (their tokens only the target's), with `new` merges of its own,
    every id but the specials' shuffled → (the tokenizer, its id → tok's id for the tokens both hold)."""
    spec = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    kept = merges[:len(merges) - drop]
    gone = {a + b for a, b in merges[len(merges) - drop:]}
    strings = [s for s, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]) if s not in gone]
    strings += [a + b for a, b in new]
    order = list(range(len(SPECIALS), len(strings)))
    random.Random(seed).shuffle(order)
    ids = list(range(len(SPECIALS))) + order
    vocab = {s: ids[i] for i, s in enumerate(strings)}
    target_vocab = tok.get_vocab()
    return bpe(vocab, kept + new), {vocab[s]: target_vocab[s] for s in strings if s in target_vocab}


def save_tokenizer(folder: Path, tok: Tokenizer) -> Path:
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def with_weights_of(target: Path, folder: Path, to_target: dict[int, int], vocab_size: int) -> Path:
    """A draft with the target's own weights under its permuted vocabulary: its id d's rows are the target's
    row to_target[d] (rows of tokens only it holds are random)."""
    save_tiny(folder, seed=7, num_hidden_layers=3, vocab_size=vocab_size)
    weights = load_file(str(target / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.randn(vocab_size, weights[name].shape[1]) * 0.02
        for d, t in to_target.items():
            rows[d] = weights[name][t]
        weights[name] = rows
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
