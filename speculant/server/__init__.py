"""The HTTP server: one package per API surface, each with its bodies beside its routes (openai/: completions and
chat; responses/; messages/: Anthropic's; tokens/), what the chat-shaped ones share (chat/), the HTTP layer
(http/: app, guard, errors, metrics, info), the engine bridge (bridge/: core, worker, auditor, recorder) and
scale-out (scaleout/: Ray Serve, replicas, routing).

http/app.py (create_app, Server) is imported where used: `speculant generate` should not pay for FastAPI.
"""
