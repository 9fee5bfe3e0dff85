"""Anthropic's Messages API: routes.py, its bodies (protocol.py), the answer's blocks (answer.py), streamed as
the SDK's messages.stream() reads them (stream.py)."""
