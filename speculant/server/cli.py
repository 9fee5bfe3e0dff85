"""`speculant serve [MODEL]`: the flags of `vllm serve`, checked before the port is bound."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket

from speculant.arguments import add_model_arguments, engine_from_args, speculative_config_from_args, whole_number
from speculant.errors import SpeculantError
from speculant.server.bridge.auditor import audit_rate, audit_settings_from_args
from speculant.server.chat.reasoning import REASONING_PARSERS
from speculant.server.http.guard import ServerLimits, limits_from_args
from speculant.server.scaleout.replicas import check_replicas, cpu_count
from speculant.server.scaleout.routing import DEFAULT_IMBALANCE

log = logging.getLogger("speculant.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="HF model folder, .gguf file or a name from `speculant models`; overrides --model "
                        "(default: the bundled SmolLM2)")
    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=whole_number(1, 65535), default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("SPECULANT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health (default: "
                        "$SPECULANT_API_KEY, else none)")
    g.add_argument("--public-metrics", action="store_true",
                   help="with --api-key: serve /metrics without the key (for a scraper)")
    g.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST",
                   help="Host names served besides localhost, 127.0.0.1, ::1 and --host; '*' for any (default none)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send; the first is used in responses (default: MODEL)")
    g.add_argument("--replicas", type=int, default=1,
                   help="whole engines serving together behind Ray Serve's proxy, each on its share of the CPUs "
                        "(--threads, default: CPUs / N); above 1 needs `pip install 'speculant[ray]'` "
                        "(docs/scale-out.md; default 1: this process serves alone)")
    g.add_argument("--routing", choices=("prefix", "load"), default="prefix",
                   help="with --replicas: send a request to the replica whose prefix cache holds the longest "
                        "prefix of its prompt (prefix), or to the less loaded of two (load: Ray's power of two "
                        "choices) (default prefix)")
    g.add_argument("--routing-imbalance", type=int, default=DEFAULT_IMBALANCE, metavar="N",
                   help="with --routing prefix: load decides when the best-matching replica has more than N "
                        f"requests more in flight than the least loaded one (default {DEFAULT_IMBALANCE})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 30)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                   help="keep a thinking model's <think>…</think> apart from its answer (chat: reasoning_content, "
                        "responses: a reasoning item): 'think' always, 'none' never, 'auto' where the tokenizer has "
                        "both tags as tokens or the chat template writes </think> (default auto)")
    g = p.add_argument_group("the lossless audit (docs/scale-out.md)")
    g.add_argument("--audit", type=audit_rate, default=0.0, metavar="RATE",
                   help="decode this share (0 to 1) of greedy and seeded requests again without speculation, in "
                        "batch rows live requests leave, and compare the tokens: /metrics counts the results, a "
                        "mismatch is logged (default 0: off)")
    g.add_argument("--record", default=None, metavar="PATH",
                   help="append each completed request (endpoint, body, prompt and returned token ids, sampling "
                        "parameters, proposer) to PATH as a JSON line, for `speculant audit PATH` (default: none)")
    d = ServerLimits()
    g = p.add_argument_group("limits (docs/server-limits.md)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"largest request body (default {d.max_body_bytes})")
    g.add_argument("--max-request-sequences", type=int, default=d.max_sequences,
                   help=f"prompts × n one request may ask for (default {d.max_sequences})")
    g.add_argument("--max-request-tokens", type=int, default=None,
                   help="prompt plus completion tokens one request may ask for, summed over its sequences "
                        "(default: max batch size × context length)")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="requests that may wait for a batch row; more get 429 with Retry-After "
                        f"(default {d.max_waiting_requests})")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may run before it ends with a 408 (default: no limit)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help=f"seconds a connection gets to send a request's headers (default {d.header_timeout_s:g})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help=f"seconds a request gets to send its body (default {d.body_timeout_s:g})")
    g.add_argument("--responses-store-size", type=int, default=d.responses_store_size,
                   help="responses /v1/responses keeps for previous_response_id and GET; past it the oldest go "
                        f"(default {d.responses_store_size})")
    g.add_argument("--responses-store-age", type=float, default=d.responses_store_age_s,
                   help=f"seconds a stored response is kept (default {d.responses_store_age_s:g})")


def check_port_free(host: str, port: int) -> None:
    """Fail before loading the model, not minutes later, when the address is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise SpeculantError(f"cannot listen on {host}:{port}: {why}") from None


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from speculant.models.loader import check_model_path
    from speculant.server.http.app import Server, create_app

    if args.model_tag:
        args.model = args.model_tag
    spec = speculative_config_from_args(args)  # a bad config fails here, before anything touches the port
    # Before Ray too: each replica loads its own model, and a wrong path would surface there as Ray's traceback.
    check_model_path(args.model)
    if spec is not None and spec.model is not None:
        check_model_path(spec.model)
    limits = limits_from_args(args)
    audit = audit_settings_from_args(args)
    if args.routing_imbalance < 0:
        raise SpeculantError(f"--routing-imbalance must be at least 0, got {args.routing_imbalance}")
    threads = check_replicas(args.replicas, args.threads, None if os.environ.get("RAY_ADDRESS") else cpu_count())
    check_port_free(args.host, args.port)
    if args.replicas > 1:
        from speculant.server.scaleout.ray_serve import serve_replicas

        return serve_replicas(args, args.replicas, threads)
    engine = engine_from_args(args)
    # The periodic "SpecDecoding metrics" line is INFO: a server shows it unless asked to be quieter.
    speculant_log = logging.getLogger("speculant")
    if speculant_log.getEffectiveLevel() > logging.INFO:
        speculant_log.setLevel(logging.INFO)
    if engine.adaptive is not None:
        # Adaptive k's cost curve, measured now (or read from its cache) rather than in the engine thread at
        # the first batch, where every stream would wait for it.
        engine.adaptive.costs  # noqa: B018
    names = args.served_model_name or ([args.model] if args.model else None)
    app = create_app(engine, names, args.api_key, limits, bind_host=args.host, audit=audit,
                     reasoning_parser=args.reasoning_parser)
    server_name = app.state.server.model_name
    how = f"{engine.proposer.name}, k={engine.k}" if engine.k else "no speculation"
    precision = f"{str(engine.model.dtype).removeprefix('torch.')}, weights {engine.target.quantization or 'none'}"
    log.info("serving %s (%s, %s, batch %d, context %d) on http://%s:%d", server_name, precision, how,
             engine.max_batch_size, engine.max_model_len, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info")
    Server(config, args.shutdown_timeout).run()
