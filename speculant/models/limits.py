"""Limits the decoder and the engine share; here so that the models package imports nothing above it."""

MAX_SPECULATIVE_TOKENS = 32
# A target pass over one sequence is a verify pass (a pending token and its drafts) up to this wide; a
# wider one is a prompt, computed the same way in every configuration.
MAX_VERIFY_WIDTH = MAX_SPECULATIVE_TOKENS + 1
ADAPTIVE_BATCHED = "batched"  # a speculative config's adaptive k from batch 2 on: the fixed k for a sequence alone
