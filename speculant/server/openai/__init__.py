"""The OpenAI API's completions and chat completions: routes.py, their bodies (protocol.py) and answers'
shapes (formats.py)."""
