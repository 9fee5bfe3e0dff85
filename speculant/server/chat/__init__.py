"""What every chat-shaped surface shares: the prompt through the chat template with tools and structured
output (prompt.py), thoughts kept apart (reasoning.py)."""
