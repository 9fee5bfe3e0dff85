"""Tokenizer, chat template and incremental detokenization."""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from speculant.errors import SpeculantError
from speculant.models import notice


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


# The variables the server gives a chat template: a request's chat_template_kwargs may not replace them.
TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "raise_exception",
                      "strftime_now"}


def _raise_exception(message: str):
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict):
        self.hf = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._said_raw = False  # encode_conversation's line, once
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: use the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values())))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.bos_id = self.token_id(self.bos_token)
        self.eos_id = self.token_id(self.eos_token)
        # Longest first: a special token that begins another must not cut it short.
        self.special_tokens = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special),
                                     key=len, reverse=True)
        self._as_text: HFTokenizer | None = None  # the same tokenizer, reading special tokens as text

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise SpeculantError(f"{path}: cannot read tokenizer ({e})") from None
        config = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            config = json.loads(cfg_path.read_text())
        if "chat_template" not in config and (folder / "chat_template.jinja").exists():
            config["chat_template"] = (folder / "chat_template.jinja").read_text()
        return cls(hf, config)

    @property
    def vocab(self) -> dict[str, int]:
        return self.hf.get_vocab(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode(self.hf, text, add_special_tokens)
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """Render the chat template in a sandbox, with the variables transformers provides (`tools`: OpenAI
        tool objects, for the templates that render them) and `template_kwargs`, the request's own variables
        (Qwen3's `enable_thinking`)."""
        if not self.chat_template:
            raise SpeculantError("this model has no chat template; use a raw prompt (--no-chat)")
        taken = sorted(set(template_kwargs or {}) & TEMPLATE_VARIABLES)
        if taken:
            raise SpeculantError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            # One dict, not keywords: a request's variable may have any name ("self" included).
            return env.from_string(self.chat_template).render({
                **(template_kwargs or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                "tools": tools, "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except TemplateError as e:
            raise SpeculantError(f"chat template error: {e}") from None

    @staticmethod
    def _encode(hf: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: 3.7 s for a 2.9 MB prompt): a
        # server tokenizing in a worker thread keeps its event loop answering.
        return hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """The chat template's prompt, with special tokens only where the template writes them: one typed
        in a message (its content, a tool call's arguments) or a tool's description is tokenized as its
        text, so a user cannot open a turn of their own."""
        nonce = secrets.token_hex(8)
        typed: list[str] = []  # the special tokens found in contents, each replaced by a placeholder

        def placeholder(match: re.Match) -> str:
            typed.append(match.group(0))
            return f"\ue000{nonce}:{len(typed) - 1}\ue001"

        pattern = re.compile("|".join(map(re.escape, self.special_tokens))) if self.special_tokens else None

        def hide(value):
            if isinstance(value, str):
                return pattern.sub(placeholder, value)
            if isinstance(value, list):
                return [hide(v) for v in value]
            if isinstance(value, dict):
                return {k: v if k == "role" else hide(v) for k, v in value.items()}
            return value

        if pattern is not None:
            messages, tools, template_kwargs = hide(messages), hide(tools), hide(template_kwargs)
        # The template already writes the BOS token where the model wants one.
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        if not typed:
            return self._encode(self.hf, prompt, False)
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", prompt)):
            if i % 2:
                ids += self._encode(self._text_tokenizer(), typed[int(piece)], False)
            elif piece:
                ids += self._encode(self.hf, piece, False)
        return ids

    def encode_conversation(self, messages: list[dict]) -> list[int]:
        """encode_chat; where the model has no chat template (a base model), its messages' texts as one raw
        prompt, said once in a line on stderr (llama.cpp's tools run such a model raw too)."""
        if self.chat_template:
            return self.encode_chat(messages)
        texts = [m.get("content") for m in messages]
        if not all(isinstance(t, str) for t in texts):
            raise SpeculantError("this model has no chat template: a raw prompt is made of text messages only")
        if not self._said_raw:
            notice.log.warning("this model has no chat template: the prompt runs raw, as with --no-chat")
            self._said_raw = True
        return self.encode("\n".join(texts))

    def _text_tokenizer(self) -> HFTokenizer:
        if self._as_text is None:
            as_text = HFTokenizer.from_str(self.hf.to_str())
            as_text.encode_special_tokens = True
            self._as_text = as_text
        return self._as_text


class Detokenizer:
    """Turns a growing list of token ids into text pieces, never emitting broken UTF-8.

    Decodes a short window of recent tokens rather than the whole output: the text of the
    window past `read_offset` is new, unless it ends in U+FFFD (an incomplete byte sequence
    waiting for the next byte-fallback token).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]
