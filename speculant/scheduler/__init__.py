"""Which sequences a step serves and which prompt chunks it feeds (scheduler.py), how large those chunks are
(chunks.py), and in which order waiting sequences get a row (policy.py)."""

from speculant.scheduler.chunks import DEFAULT_PREFILL_CHUNK, ChunkSizer, Prefill
from speculant.scheduler.policy import RoundRobin, first_come
from speculant.scheduler.scheduler import ChunkPlan, Scheduler

__all__ = ["DEFAULT_PREFILL_CHUNK", "ChunkPlan", "ChunkSizer", "Prefill", "RoundRobin", "Scheduler", "first_come"]
