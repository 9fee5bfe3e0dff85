"""The engine bridge: the server's engine-facing core (core.py), the engine thread (worker.py), the live lossless
audit (auditor.py) and the record file (recorder.py)."""
