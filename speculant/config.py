"""Request sampling parameters, the speculative configuration (vLLM's JSON shape) and the engine's whole
configuration, each validated; `engine_config` is the one resolver every way in (CLI, server, LLM) goes through."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from speculant.errors import SpeculantError
from speculant.models.limits import ADAPTIVE_BATCHED, MAX_SPECULATIVE_TOKENS, MAX_VERIFY_WIDTH  # noqa: F401 (re-exported)
from speculant.models.registry import gguf_draft

MAX_LOGPROBS = 20
DEFAULT_PREFILL_CHUNK = 512  # the most prompt tokens a pass feeds (scheduler/chunks.py)
MAX_TREE_WIDTH = 8
MAX_HISTORY_TOKENS = 10_000_000  # an answer history holds ~220 bytes a token (its lists and index entry)
METHODS = ("draft_model", "ngram", "eagle", "eagle3", "mtp")
# Other names for a method, as configs written for other engines spell it.
METHOD_ALIASES = {"draft": "draft_model"}
# Method names vLLM documents that Speculant does not run, each with why and what to pass instead.
UNSUPPORTED_METHODS = {
    "medusa": "Medusa heads are not loaded here; pass \"eagle\" (a head from `speculant train-draft --kind "
              "eagle`) or \"draft_model\"",
    "mlp_speculator": "IBM's MLP speculators are not loaded here; pass \"eagle\" (a head from `speculant "
                      "train-draft --kind eagle`) or \"draft_model\"",
    "suffix": "suffix decoding is not built; pass its nearest here, \"ngram\" with \"history_tokens\" (drafts "
              "from the prompt and from earlier answers)",
}
# Below this a temperature is greedy: dividing logits by 1e-40 underflows in float32 (to inf or nan), and
# long before that the distribution is the argmax's one-hot anyway (vLLM uses the same 1e-5).
MIN_TEMPERATURE = 1e-5
# A top_k past the vocabulary is "off"; bounded so that it fits the int64 sampling tensors.
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a constrained answer must match, one of: a JSON schema (`json`, a dict or its JSON text), any
    JSON object (`json_object`), a regular expression, one of the strings of `choice`, or a Lark grammar
    (llguidance's dialect). vLLM's field of the same name; compiled by speculant/structured/grammar.py."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] * bool(self.json_object)
        if len(given) != 1:
            raise SpeculantError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                                 f"got {', '.join(given) or 'none'}")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise SpeculantError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def key(self) -> tuple[str, Any]:
        """(kind, text): what identifies the compiled grammar (its cache key)."""
        if self.json_object:
            return "json_object", ""
        if self.json is not None:
            # Unsorted: the schema's order of properties is the order the answer writes them in.
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) means greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; n: the chosen token's log-probability and the top n
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's log-probability and the top n
    structured_outputs: StructuredOutputsParams | None = None  # None: free text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        checks = [
            ("temperature", isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
             and self.temperature >= 0, "must be a finite number >= 0"),
            ("top_k", isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K,
             f"must be -1 (off) or in [0, {MAX_TOP_K}]"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1
             or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             "must be >= 1 (0 only to score the prompt, with prompt_logprobs)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "must be a StructuredOutputsParams"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise SpeculantError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    # The earlier occurrence that matches a longer suffix continues right more often.
    prompt_lookup_max: int = 6
    # Our extension: choose k per step (0..num_speculative_tokens) from the measured cost curve and
    # the running acceptance; speculation switches itself off where it would lose. "batched": only for a
    # batch of 2 or more sequences; one alone drafts num_speculative_tokens (where a verify pass of k + 1
    # tokens costs about one, a draft model's own rules decide there, and the policy's caution only costs).
    adaptive: bool | str = False
    # Our extension, for draft_model and eagle: where prompt lookup finds a match (prompt_lookup_min
    # to _max tokens) its drafts are verified instead, free; the model drafts the other steps.
    lookup_first: bool = False
    # Our extension, for eagle and draft_model: the drafts are a tree of num_speculative_tokens + tree_width - 1
    # nodes at most num_speculative_tokens deep, grown where the drafter is confident (proposers/draft_tree.py)
    # and verified in one pass (a draft model's: fewer where the target's cost curve says so, and chains in a
    # batch; proposers/draft_model_tree.py).
    tree_width: int = 1
    # Our extension, for ngram and lookup_first: a corpus table (proposers/corpus.py, a file or its folder)
    # whose drafts are verified where prompt lookup matches fewer than 2 tokens.
    corpus: str | None = None
    # Our extension, for ngram and lookup_first: keep the last history_tokens tokens of answers and, for
    # greedy rows, draft what followed a sequence's last 8 tokens in the latest answer that has them
    # (proposers/history.py). 0: off. Opt-in: a request's speed then depends on the requests served before it.
    history_tokens: int = 0
    # Our extension, for draft_model: the draft scores only the tokens of ids below draft_vocab_size and the
    # added tokens (proposers/draft_vocab.py), a cheaper head. 0: the whole vocabulary.
    draft_vocab_size: int = 0
    # Our extension, for draft_model (llama.cpp's --draft-p-min): a draft stops where its likeliest token has
    # a probability below draft_p_min (proposers/draft_model.py). 0: always k drafts.
    draft_p_min: float = 0.0
    # Our extension, for draft_model: a draft stops where the draft's probability of the tokens it has drawn
    # falls below draft_p_chain, checked before the pass that would draft the next one (which it saves): a late
    # draft pays only where every draft before it is kept too. 0: off.
    draft_p_chain: float = 0.0
    # Our extension, for draft_model: "q4_0" requantizes a GGUF draft's matrices stored wider than Q4_0 where it
    # runs on its own blocks (a cheaper draft pass; the output stays the target's). None: the file as it is.
    draft_quantization: str | None = None

    @property
    def proposer(self) -> str:
        """The proposer as reports name it: ngram, eagle, eagle+lookup (lookup first), eagle+tree (a draft
        tree), ngram+corpus (a corpus table behind lookup), draft_model+vocab32768+pmin0.6 …"""
        return (self.method + "+lookup" * self.lookup_first + "+corpus" * (self.corpus is not None)
                + "+history" * (self.history_tokens > 0) + "+tree" * (self.tree_width > 1)
                + f"+vocab{self.draft_vocab_size}" * bool(self.draft_vocab_size)
                + f"+pmin{self.draft_p_min:g}" * bool(self.draft_p_min)
                + f"+pchain{self.draft_p_chain:g}" * bool(self.draft_p_chain) + "+q4_0" * bool(self.draft_quantization))

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string, or a path to a JSON/YAML file; None stays None."""
        if value is None:
            return None
        if isinstance(value, str):
            value = _load_json_or_file(value)
        if not isinstance(value, dict):
            raise SpeculantError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculantError(f"speculative config: unknown key(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known))}")
        method = value.get("method")
        if method is None and value.get("model"):
            method = "draft_model"
        if isinstance(method, str):
            # A name ending in "_mtp" (deepseek_mtp, qwen3_next_mtp, …) is vLLM's per-family spelling of mtp.
            method = "mtp" if method.endswith("_mtp") else METHOD_ALIASES.get(method, method)
        given = {key: v for key, v in value.items() if key not in ("method", "num_speculative_tokens")}
        cfg = cls(method=method, num_speculative_tokens=value.get("num_speculative_tokens"), **given)
        for ok, error in CHECKS:
            if not ok(cfg):
                raise SpeculantError(f"speculative config: {error(cfg)}")
        return cfg


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def method_error(method: object) -> str:
    """Why a method name is refused: not run here (with what to pass instead), or unknown."""
    if isinstance(method, str):
        reason = UNSUPPORTED_METHODS.get(method)
        if reason:
            return f"method {method!r} is not supported: {reason}"
    return f"unknown method {method!r}; choose one of {', '.join(METHODS)} (or \"draft\" for draft_model)"


def _uses_lookup(c: SpeculativeConfig) -> bool:
    return c.method == "ngram" or c.lookup_first



# (what a valid config satisfies, the error otherwise), in order: each check may assume those before it passed.
CHECKS: tuple[tuple[Callable[[SpeculativeConfig], bool], Callable[[SpeculativeConfig], str]], ...] = (
    (lambda c: c.method in METHODS, lambda c: method_error(c.method)),
    (lambda c: _is_int(c.num_speculative_tokens),
     lambda c: "num_speculative_tokens (an integer) is required"),
    (lambda c: 1 <= c.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
     lambda c: f"num_speculative_tokens={c.num_speculative_tokens} is out of range [1, {MAX_SPECULATIVE_TOKENS}]"),
    (lambda c: isinstance(c.adaptive, bool) or c.adaptive == ADAPTIVE_BATCHED,
     lambda c: f"adaptive must be true, false or {ADAPTIVE_BATCHED!r}, got {c.adaptive!r}"),
    (lambda c: isinstance(c.lookup_first, bool),
     lambda c: f"lookup_first must be true or false, got {c.lookup_first!r}"),
    (lambda c: not (c.lookup_first and c.method == "ngram"),
     lambda c: "lookup_first puts prompt lookup ahead of a model's drafts; it needs method draft_model or eagle"),
    (lambda c: _is_int(c.tree_width) and 1 <= c.tree_width <= MAX_TREE_WIDTH,
     lambda c: f"tree_width={c.tree_width!r} is out of range [1, {MAX_TREE_WIDTH}]"),
    (lambda c: c.tree_width == 1 or c.method in ("eagle", "eagle3", "draft_model"),
     lambda c: "tree_width (a draft tree) needs method eagle, eagle3 or draft_model"),
    (lambda c: c.num_speculative_tokens + c.tree_width - 1 <= MAX_SPECULATIVE_TOKENS,
     lambda c: f"num_speculative_tokens + tree_width - 1 = {c.num_speculative_tokens + c.tree_width - 1} drafts "
               f"a step; at most {MAX_SPECULATIVE_TOKENS}"),
    (lambda c: c.corpus is None or (isinstance(c.corpus, str) and bool(c.corpus)),
     lambda c: f"corpus must be a path, got {c.corpus!r}"),
    (lambda c: _is_int(c.history_tokens) and 0 <= c.history_tokens <= MAX_HISTORY_TOKENS,
     lambda c: f"history_tokens={c.history_tokens!r} is out of range [0, {MAX_HISTORY_TOKENS}]"),
    (lambda c: not c.history_tokens or _uses_lookup(c),
     lambda c: "history_tokens (drafts from earlier answers) works with prompt lookup; it needs method ngram or "
               "lookup_first"),
    (lambda c: not c.corpus or _uses_lookup(c),
     lambda c: "corpus drafts where prompt lookup finds little; it needs method ngram or lookup_first"),
    (lambda c: _is_int(c.draft_vocab_size) and c.draft_vocab_size >= 0,
     lambda c: f"draft_vocab_size={c.draft_vocab_size!r} must be an integer >= 0 (0: the whole vocabulary)"),
    (lambda c: isinstance(c.draft_p_min, (int, float)) and not isinstance(c.draft_p_min, bool)
     and 0 <= c.draft_p_min < 1,
     lambda c: f"draft_p_min={c.draft_p_min!r} is out of range [0, 1)"),
    (lambda c: isinstance(c.draft_p_chain, (int, float)) and not isinstance(c.draft_p_chain, bool)
     and 0 <= c.draft_p_chain < 1,
     lambda c: f"draft_p_chain={c.draft_p_chain!r} is out of range [0, 1)"),
    (lambda c: c.draft_quantization in (None, "q4_0"),
     lambda c: f"draft_quantization={c.draft_quantization!r}: choose \"q4_0\" or leave it out"),
    (lambda c: c.draft_quantization is None or gguf_draft(c.model),
     lambda c: f"draft_quantization requantizes a GGUF draft's blocks; {c.model!r} is not a .gguf file or a name "
               "from `speculant models`"),
    (lambda c: c.method == "draft_model" or not (c.draft_vocab_size or c.draft_p_min or c.draft_p_chain
                                                 or c.draft_quantization),
     lambda c: "draft_vocab_size, draft_p_min, draft_p_chain and draft_quantization shape a draft model's drafts; "
               "they need method draft_model"),
    (lambda c: c.method in ("ngram", "mtp") or bool(c.model),
     lambda c: "method 'eagle3' needs \"model\": the EAGLE-3 head's folder (config.json + model.safetensors, "
               "SpecForge, vLLM speculators or ModelOpt; `speculant train-draft --kind eagle3` writes one)"
     if c.method == "eagle3" else f"method {c.method!r} needs \"model\" (the draft's path)"),
    (lambda c: not _uses_lookup(c) or (isinstance(c.prompt_lookup_min, int) and isinstance(c.prompt_lookup_max, int)
                                       and 1 <= c.prompt_lookup_min <= c.prompt_lookup_max),
     lambda c: f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {c.prompt_lookup_min} and "
               f"{c.prompt_lookup_max}"),
)


def _load_json_or_file(text: str) -> dict:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        path = Path(stripped).expanduser()
        if not path.exists():
            raise SpeculantError(f"speculative config: not a JSON object and no such file: {text}")
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            try:
                return yaml.safe_load(path.read_text())
            except yaml.YAMLError as e:
                raise SpeculantError(f"speculative config: invalid YAML in {path}: {e}") from None
        stripped = path.read_text()
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as e:
        raise SpeculantError(f"speculative config: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") \
            from None


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from: the model and how it loads, the speculation, the batch, the context and
    the prefix cache's budget. Made by `engine_config`, checked once, read by llm.engine_from_config."""

    model: str | None = None  # a folder, a .gguf file or a name from `speculant models`; None: the bundled model
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str | None = "auto"
    speculative: SpeculativeConfig | None = None  # None: plain decoding
    max_batch_size: int = 8
    max_model_len: int | None = None  # None: the model's own, as far as the KV cache fits (context.context_for)
    prefix_cache_bytes: int | None = None  # None: prefix_cache.default_capacity_bytes() on CPU, none on CUDA
    prefix_cache_dir: str | None = None  # the prefix cache written through to this folder too (prefix_store.py)
    prefix_cache_disk_bytes: int | None = None  # the most it holds; None: prefix_store.default_disk_bytes
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # 0: every prompt in one pass

    def __post_init__(self):
        if not (_is_int(self.max_batch_size) and self.max_batch_size >= 1):
            raise SpeculantError(f"max_batch_size must be at least 1, got {self.max_batch_size!r}")
        if self.max_model_len is not None and not (_is_int(self.max_model_len) and self.max_model_len >= 2):
            raise SpeculantError(f"max_model_len={self.max_model_len!r} is too small")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise SpeculantError(f"the prefix cache's budget must be at least 0, got {self.prefix_cache_bytes}")
        if self.prefix_cache_disk_bytes is not None and not (_is_int(self.prefix_cache_disk_bytes)
                                                             and self.prefix_cache_disk_bytes >= 0):
            raise SpeculantError(f"the prefix cache's disk budget must be at least 0, got "
                                 f"{self.prefix_cache_disk_bytes!r}")
        if self.prefix_cache_dir is not None and not (isinstance(self.prefix_cache_dir, str) and self.prefix_cache_dir):
            raise SpeculantError(f"prefix_cache_dir must be a folder's path, got {self.prefix_cache_dir!r}")
        if self.prefix_cache_dir is not None and self.prefix_cache_bytes == 0:
            raise SpeculantError("a prefix cache folder keeps what the prefix cache holds, and it is off "
                                 "(prefix_cache_bytes 0, --no-enable-prefix-caching)")
        if not (_is_int(self.prefill_chunk) and self.prefill_chunk >= 0):
            raise SpeculantError(f"prefill chunk must be at least 0 (0: no chunks), got {self.prefill_chunk!r}")


def engine_config(model: str | None = None, speculative_config: str | dict | SpeculativeConfig | None = None,
                  **settings: Any) -> EngineConfig:
    """The one resolver: a speculative config as vLLM's JSON (a dict, a JSON string or a file), "auto" (the named
    model's shipped default: the bundled model's best proposer, a named model's sibling draft, else plain
    decoding) or None, with the other settings (EngineConfig's fields) → a frozen, checked EngineConfig."""
    return EngineConfig(model=model, speculative=resolve_speculative_config(model, speculative_config), **settings)


def resolve_speculative_config(model: str | None,
                               speculative_config: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    if isinstance(speculative_config, SpeculativeConfig):
        return speculative_config
    if speculative_config == "auto":
        from speculant.defaults import default_speculative_config

        speculative_config = default_speculative_config(model)
    return SpeculativeConfig.parse(speculative_config)
