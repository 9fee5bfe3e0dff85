"""OpenAI-compatible HTTP server: continuous batching over one engine thread, Prometheus metrics.

app.py (create_app, Server) is imported where used: `speculant generate` should not pay for FastAPI.
"""
