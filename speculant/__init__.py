"""Speculant: speculative decoding that makes a model answer faster with identical output."""

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.errors import SpeculantError
from speculant.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig", "SpeculantError"]
