"""Scale-out: whole engines as Ray Serve replicas (ray_serve.py), their checks, sessions and metrics
(replicas.py), prefix-aware routing (routing.py)."""
