"""The HTTP layer: the app and its routes' wiring (app.py), the guard in front (guard.py), the error body and
body parsing (errors.py), metrics (metrics.py), models, health and metrics routes (info.py)."""
