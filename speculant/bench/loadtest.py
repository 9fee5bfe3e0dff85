"""Load test: N concurrent clients against two live servers, without and with speculation, same run.

    python -m speculant.bench.loadtest                          # bundled model, ngram k=4, 1/4/16 clients
    python -m speculant.bench.loadtest --model PATH --clients 1 8 --speculative-config '{"method": ...}'

Both servers run side by side (an idle one sleeps) and each concurrency level is measured on the
baseline then on the speculative server, so a drift in the machine's load hits both alike. Requests
are greedy chat completions: the outputs must be identical across the two servers, and are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PROMPTS = [
    "Rewrite this sentence with correct grammar: me and him goes to the store yesterday and buyed three "
    "apple.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in two sentences: The quick brown fox jumps over the lazy dog. The dog sleeps all day "
    "while the fox runs through the forest, looking for food and a place to rest.",
    "List the days of the week, one per line.",
    "Explain what a hash map is to a beginner.",
    "Translate to French: The cat is on the table and the dog is under the chair.",
    "Write a haiku about the sea.",
    "Fix the bug: def add(a, b): return a - b",
]


@dataclass
class Reply:
    prompt: str
    latency_s: float
    completion_tokens: int
    text: str
    drafted: int
    accepted: int


@dataclass
class Level:
    clients: int
    replies: list[Reply]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.replies)

    def latency(self, q: float) -> float:
        """Nearest-rank percentile of the request latencies."""
        ordered = sorted(r.latency_s for r in self.replies)
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    @property
    def acceptance(self) -> float | None:
        drafted = sum(r.drafted for r in self.replies)
        return sum(r.accepted for r in self.replies) / drafted if drafted else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, speculation: list[str], max_batch_size: int,
                 log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "speculant.cli", "serve", *([model] if model else []), "--port", str(port),
           "--max-batch-size", str(max_batch_size), *speculation]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}; see its log above")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server at {url} did not become healthy in {timeout_s:.0f}s")


def chat(url: str, prompt: str, max_tokens: int) -> Reply:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.load(r)
    stats = out.get("speculative_stats") or {}
    return Reply(prompt, time.perf_counter() - t0, out["usage"]["completion_tokens"],
                 out["choices"][0]["message"]["content"], stats.get("num_draft_tokens", 0),
                 stats.get("num_accepted_tokens", 0))


def run_level(url: str, clients: int, per_client: int, max_tokens: int) -> Level:
    """`clients` threads, each sending `per_client` requests one after another."""

    def client(c: int) -> list[Reply]:
        prompts = [PROMPTS[(c * per_client + i) % len(PROMPTS)] for i in range(per_client)]
        return [chat(url, prompt, max_tokens) for prompt in prompts]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = [r for batch in pool.map(client, range(clients)) for r in batch]
    return Level(clients, replies, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m speculant.bench.loadtest",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16],
                   help="concurrency levels (default 1 4 16)")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    args = p.parse_args(argv)

    configs = {"no speculation": ["--no-speculation"],
               "speculation": ["--speculative-config", args.speculative_config]}
    log = tempfile.NamedTemporaryFile("w+", prefix="speculant-loadtest-", suffix=".log", delete=False)
    servers = {name: start_server(args.model, flags, max(args.clients), log)
               for name, flags in configs.items()}
    results: dict[str, list[Level]] = {name: [] for name in configs}
    try:
        for proc, url in servers.values():
            wait_healthy(proc, url)
            chat(url, PROMPTS[0], 8)  # warm-up: first-call allocations stay out of the numbers
        for clients in args.clients:
            for name, (_, url) in servers.items():
                level = run_level(url, clients, args.requests_per_client, args.max_tokens)
                results[name].append(level)
                print(f"{name:>15} | {clients:>2} clients: {level.tokens / level.wall_s:6.1f} tokens/s",
                      file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(60)
        log.close()
    report(results, args, log.name)


def report(results: dict[str, list[Level]], args: argparse.Namespace, log_path: str) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nload test: greedy chat, max_tokens {args.max_tokens}, {args.requests_per_client} requests per client;"
          f" speculation {args.speculative_config}; {os.cpu_count()} CPUs, load average {load}; "
          f"server log {log_path}\n")
    print("| config | clients | requests | tokens | tokens/s | p50 latency s | p95 latency s | acceptance |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, levels in results.items():
        for lv in levels:
            acc = f"{100 * lv.acceptance:.0f}%" if lv.acceptance is not None else "-"
            cells = [name, lv.clients, len(lv.replies), lv.tokens, f"{lv.tokens / lv.wall_s:.1f}",
                     f"{lv.latency(0.5):.2f}", f"{lv.latency(0.95):.2f}", acc]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    base, spec = results["no speculation"], results["speculation"]
    for b, s in zip(base, spec, strict=True):
        speedup = (s.tokens / s.wall_s) / (b.tokens / b.wall_s)
        same = {r.prompt: r.text for r in b.replies} == {r.prompt: r.text for r in s.replies}
        print(f"{b.clients} clients: speed-up {speedup:.2f}x, outputs identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
