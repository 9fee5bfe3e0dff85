"""Structured output: grammars as token masks (grammar.py) and tool calls in the chat templates' formats (tools.py)."""
