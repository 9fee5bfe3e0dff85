"""The offline Python API, shaped like vLLM's: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

from dataclasses import dataclass

from speculant.adaptive import AdaptiveK, cost_curve_for
from speculant.config import (
    ADAPTIVE_BATCHED,
    DEFAULT_PREFILL_CHUNK,
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
    engine_config,
)
from speculant.context import cache_len, context_for
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import LoadedModel, load_model
from speculant.prefix_cache import default_capacity_bytes
from speculant.proposers import build_proposer
from speculant.sequence import Sequence, TokenLogprob

Prompt = str | dict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @classmethod
    def from_sequence(cls, seq: Sequence, prompt: str | None) -> RequestOutput:
        out = CompletionOutput(0, seq.text, seq.output_ids, seq.finish_reason,
                               seq.logprobs if seq.params.logprobs is not None else None)
        return cls(seq.request_id, prompt, seq.prompt_ids, [out], seq.metrics())


def build_engine(model: str | None = None, dtype: str = "float32", device: str = "cpu",
                 speculative_config: str | dict | SpeculativeConfig | None = None, quantization: str | None = None,
                 **settings) -> Engine:
    """An engine from settings given by name (EngineConfig's fields), through the one resolver; the defaults
    are the library's plain ones (fp32, no quantization), LLM's and the CLI's are "auto"."""
    return engine_from_config(engine_config(model, speculative_config, dtype=dtype, device=device,
                                            quantization=quantization, **settings))


def engine_from_config(config: EngineConfig) -> Engine:
    """Load the target and build its engine. What depends on the loaded model is decided here: the context
    (the model's own as far as the KV cache fits, context.context_for) and the prefix cache's default budget
    (CPU only: CUDA attends prompts on blocked kernels whose sums depend on the pass)."""
    target = load_model(config.model, dtype=config.dtype, device=config.device, quantization=config.quantization)
    context = context_for(target.config, config.max_model_len, config.max_batch_size, target.model.dtype,
                          target.model.device)
    prefix_cache_bytes = config.prefix_cache_bytes
    if prefix_cache_bytes is None:
        prefix_cache_bytes = default_capacity_bytes() if target.model.device.type == "cpu" else 0
    return engine_for(target, config.speculative, config.max_batch_size, context, prefix_cache_bytes,
                      config.prefill_chunk, config.prefix_cache_dir, config.prefix_cache_disk_bytes)


def engine_for(target: LoadedModel, spec: SpeculativeConfig | None, max_batch_size: int,
               max_model_len: int, prefix_cache_bytes: int = 0,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefix_cache_dir: str | None = None,
               prefix_cache_disk_bytes: int | None = None) -> Engine:
    """An engine over an already-loaded target, with the proposer and adaptive policy `spec` asks for."""
    k = spec.num_speculative_tokens if spec else 0
    proposer = build_proposer(spec, target, max_batch_size, cache_len(max_model_len, k)) if spec else None
    adaptive = None
    if spec is not None and spec.adaptive:
        extra = proposer.extra_nodes
        def load_curve():
            return cost_curve_for(target.model, max_batch_size, k + extra + 1)

        batched = spec.adaptive == ADAPTIVE_BATCHED
        adaptive = AdaptiveK(None if batched else load_curve(), k, extra_nodes=extra, from_batch=2 if batched else 1,
                             load_curve=load_curve, extra_at=proposer.extra_nodes_at)
    return Engine(target, proposer, k, max_batch_size, max_model_len, adaptive=adaptive,
                  prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk,
                  prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_bytes=prefix_cache_disk_bytes)


class LLM:
    """The defaults are `speculant generate`'s: dtype and quantization "auto" (a GGUF file runs at the
    precision it stores, bfloat16 where the CPU has fast kernels for it), and speculative_config "auto"
    (the bundled model's best shipped proposer, plain decoding for other models; None: plain decoding).
    `model` is a folder, a .gguf file or a name from `speculant models`; None is the bundled model.
    `prefix_cache_dir`: the prefix cache is written to that folder too and read back by later processes."""

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 speculative_config: str | dict | SpeculativeConfig | None = "auto", max_batch_size: int = 8,
                 max_model_len: int | None = None, quantization: str | None = "auto",
                 prefix_cache_bytes: int | None = None, prefix_cache_dir: str | None = None,
                 prefix_cache_disk_bytes: int | None = None):
        self.engine = engine_from_config(engine_config(
            model, speculative_config, dtype=dtype, device=device, max_batch_size=max_batch_size,
            max_model_len=max_model_len, quantization=quantization, prefix_cache_bytes=prefix_cache_bytes,
            prefix_cache_dir=None if prefix_cache_dir is None else str(prefix_cache_dir),
            prefix_cache_disk_bytes=prefix_cache_disk_bytes))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = prompts if isinstance(prompts, list) else [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        params = sampling_params
        if len(params) != len(prompts):
            raise SpeculantError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = self.engine.add_requests((self._prompt_ids(p), sp) for p, sp in zip(prompts, params))
        self.engine.generate(seqs)
        return [RequestOutput.from_sequence(s, p if isinstance(p, str) else None) for s, p in zip(seqs, prompts)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        self._need_tokenizer()
        prompts = [{"prompt_token_ids": self.tokenizer.encode_conversation(c)} for c in conversations]
        return self.generate(prompts, sampling_params)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise SpeculantError("a dict prompt needs 'prompt_token_ids'")
            return list(prompt["prompt_token_ids"])
        self._need_tokenizer()
        return self.tokenizer.encode(prompt)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise SpeculantError("this model has no tokenizer.json: pass {'prompt_token_ids': [...]} prompts")
