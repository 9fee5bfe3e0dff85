"""vLLM's POST /tokenize and /detokenize: routes.py and their bodies (protocol.py)."""
