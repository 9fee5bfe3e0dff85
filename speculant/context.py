"""The context a model is served with: the length asked for, else the model's own as far as a KV cache of
the batch's rows fits in a share of the machine's memory."""

from __future__ import annotations

import logging
import os

import torch

from speculant.errors import SpeculantError
from speculant.models.model_config import ModelConfig

log = logging.getLogger("speculant")

DEFAULT_MAX_MODEL_LEN = 2048  # an Engine built directly; LLM and the CLI serve the model's own (context_for)
KV_MEMORY_SHARE = 0.25  # of the machine's memory: what the KV cache may take by default


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The context length served: the request, else a default that keeps the KV cache small,
    never beyond what the model was trained for."""
    if requested is not None and requested < 2:
        raise SpeculantError(f"max_model_len={requested} is too small")
    return min(requested or DEFAULT_MAX_MODEL_LEN, cfg.max_position_embeddings)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def context_for(cfg: ModelConfig, requested: int | None, max_batch_size: int, dtype: torch.dtype,
                device: torch.device) -> int:
    """The context served when none is asked for: the model's own, as far as a KV cache of
    max_batch_size rows fits in KV_MEMORY_SHARE of the machine's memory (agents' prompts are long)."""
    if requested is not None:
        return resolve_max_model_len(cfg, requested)
    own = cfg.max_position_embeddings
    per_row = kv_bytes_per_token(cfg, dtype)
    fits = int(KV_MEMORY_SHARE * memory_bytes(device)) // (max_batch_size * per_row)
    n = own if fits >= own else max(DEFAULT_MAX_MODEL_LEN, fits // 1024 * 1024)
    size = max_batch_size * n * per_row / 2**30
    if n < own:
        log.warning("context %d tokens (the model's own is %d): a KV cache of %d rows of %d tokens could grow "
                    "to %.1f GiB; this one to %.1f GiB. --max-model-len or --max-batch-size change it",
                    n, own, max_batch_size, own, max_batch_size * own * per_row / 2**30, size)
    return n


def cache_len(max_model_len: int, k: int, extra_nodes: int = 0) -> int:
    """Positions a KV cache row holds: the context, and the spare ones a verify pass writes before knowing how
    many stay (k drafts, a tree's other candidates, the pending token)."""
    return max_model_len + k + extra_nodes + 1
