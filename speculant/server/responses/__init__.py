"""The OpenAI Responses API: routes.py, its bodies (protocol.py), stored responses (store.py)."""
