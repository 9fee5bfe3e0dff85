"""Agent and chat workloads through the HTTP API, beside llama-server on the same GGUF file.

Agents and chat clients resend their whole conversation, or one long system prompt, at every call; what
they wait for is the first token of each call. Each workload runs streaming chat completions, greedy,
against `speculant serve` and `llama-server` (one slot, `cache_prompt` on, as its users run it), one
server after the other for each workload:

- conversation: a 6-turn coding conversation, each call the whole conversation so far;
- system: 5 calls sharing a ~660-token system prompt of tool descriptions, different questions;
- concurrent: 4 clients × 3 requests at once, aggregate tokens/s (llama-server with -np 4);
- long-prompt: 3 streams decode while a 4,000-token prompt arrives: their inter-token latency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from speculant.bench.peers import LlamaServer, _free_port, _stop, llama_server_binary

WORKLOADS = ("conversation", "system", "concurrent", "long-prompt")
START_S = 900  # a fresh machine builds the kernels and measures the cost curve before the server answers


@dataclass
class Call:
    ttft_s: float
    total_s: float
    tokens: int  # streamed content chunks (llama-server and speculant send about one per token)
    text: str
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks after the first


def chat(url: str, messages: list[dict], max_tokens: int, model: str = "m") -> Call:
    """One streaming chat completion, greedy."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, last, text, gaps, n = None, None, [], [], 0
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            piece = choices[0].get("delta", {}).get("content") if choices else None
            if not piece:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            text.append(piece)
            n += 1
    end = time.perf_counter()
    return Call((first or end) - t0, end - t0, n, "".join(text), gaps)


class SpeculantServer:
    """`speculant serve` as a user starts it, on a free loopback port."""

    def __init__(self, model: str, threads: int, n_ctx: int, extra: tuple[str, ...] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "speculant.cli", "serve", "--model", model, "--threads", str(threads),
               "--max-model-len", str(n_ctx), "--port", str(self.port), "--served-model-name", "m", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"speculant serve exited: {self.log.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"speculant serve did not answer /health within {START_S} s")

    def close(self) -> None:
        self._finalizer()
        self.log.close()


def agent_prompts() -> dict:
    return json.loads(resources.files("speculant.data").joinpath("prompts/agents.json").read_text())


def conversation(url: str, turns: list[str], max_tokens: int) -> list[Call]:
    messages, calls = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        call = chat(url, messages, max_tokens)
        messages.append({"role": "assistant", "content": call.text})
        calls.append(call)
    return calls


def shared_system(url: str, system: str, questions: list[str], max_tokens: int) -> list[Call]:
    return [chat(url, [{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens)
            for q in questions]


def concurrent(url: str, questions: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests one after the other → aggregate tokens/s."""
    calls: list[Call] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(per_client):
            q = questions[(c * per_client + i) % len(questions)]
            call = chat(url, [{"role": "user", "content": q}], max_tokens)
            with lock:
                calls.append(call)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(c.tokens for c in calls)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "median_latency_s": statistics.median(c.total_s for c in calls)}


def long_prompt(url: str, questions: list[str], filler: str, max_tokens: int) -> dict:
    """3 streams decode; once they are under way a ~4,000-token prompt arrives. Their gaps between tokens
    while it is prefilled, against their gaps before it arrives."""
    results: list[Call] = [None] * 3  # type: ignore[list-item]
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        started.wait()
        results[i] = chat(url, [{"role": "user", "content": questions[i]}], max_tokens)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(3.0)  # the streams are decoding
    arrival = chat(url, [{"role": "user", "content": filler + "\n\nSummarize the text above in one line."}], 8)
    for t in threads:
        t.join()
    gaps = sorted(g for c in results for g in c.itl_s)
    return {"itl_median_s": statistics.median(gaps), "itl_p99_s": gaps[int(0.99 * (len(gaps) - 1))],
            "itl_max_s": gaps[-1], "long_prompt_ttft_s": arrival.ttft_s,
            "stream_tokens": sum(c.tokens for c in results)}


def long_filler(tokens: int = 4000) -> str:
    """About `tokens` tokens of varied text (≈ 4 characters a token)."""
    data = agent_prompts()
    parts, size = [], 0
    i = 0
    while size < 4 * tokens:
        piece = f"Section {i}. " + data["system"][(i * 97) % 800:(i * 97) % 800 + 400]
        parts.append(piece)
        size += len(piece)
        i += 1
    return "\n".join(parts)


def geo_mean(xs: list[float]) -> float:
    return float(statistics.geometric_mean(xs)) if xs else float("nan")


def summarize(name: str, ours: list[Call], theirs: list[Call]) -> dict:
    later = slice(1, None)
    ratio_ttft = [a.ttft_s / b.ttft_s for a, b in zip(ours[later], theirs[later])]
    return {"workload": name,
            "ours_ttft_s": [round(c.ttft_s, 3) for c in ours], "theirs_ttft_s": [round(c.ttft_s, 3) for c in theirs],
            "ttft_ratio_later_calls_geomean": geo_mean(ratio_ttft),
            "ours_wall_s": sum(c.total_s for c in ours), "theirs_wall_s": sum(c.total_s for c in theirs),
            "wall_speedup": sum(c.total_s for c in theirs) / sum(c.total_s for c in ours),
            "same_text": [a.text == b.text for a, b in zip(ours, theirs)]}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a GGUF file or a name from `speculant models`")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--serve-args", default="", help="more `speculant serve` flags, one string")
    p.add_argument("--no-peer", action="store_true", help="speculant alone")
    p.add_argument("--out", "-o", default=None, help="write report.json and report.md here")


def run(args: argparse.Namespace) -> dict:
    from speculant.models.registry import named_model_path

    model_file = named_model_path(args.model) or Path(args.model)
    data = agent_prompts()
    binary = None if args.no_peer else llama_server_binary()
    report: dict = {"cpu": cpu_name(), "threads": args.threads, "model": str(model_file), "date": time.strftime("%F"),
                    "workloads": []}
    ours_cmd = tuple(args.serve_args.split())

    def with_ours(fn, extra=()):
        server = SpeculantServer(args.model, args.threads, args.ctx, ours_cmd + tuple(extra))
        try:
            return fn(server.url)
        finally:
            server.close()

    def with_theirs(fn, slots: int = 1):
        if binary is None:
            return None
        server = LlamaServer(binary, model_file, args.threads, args.ctx * slots,
                             extra=("-np", str(slots), "--jinja"))
        try:
            return fn(server.url)
        finally:
            server.close()

    filler = long_filler()
    workloads = {
        "conversation": lambda url: conversation(url, data["conversation"], args.max_tokens),
        "system": lambda url: shared_system(url, data["system"], data["questions"], args.max_tokens),
        "concurrent": lambda url: concurrent(url, data["questions"] + data["conversation"], 4, 3, 128),
        "long-prompt": lambda url: long_prompt(url, data["questions"], filler, 160),
    }
    for w in args.workloads:
        print(f"workload {w} …", file=sys.stderr, flush=True)
        fn = workloads[w]
        if w in ("conversation", "system"):
            ours, theirs = with_ours(fn), with_theirs(fn)
            entry = summarize(w, ours, theirs) if theirs else {"workload": w, "ours": [asdict(c) for c in ours]}
        elif w == "concurrent":
            entry = {"workload": w, "ours": with_ours(fn), "theirs_np4": with_theirs(fn, slots=4)}
        else:
            entry = {"workload": w, "ours": with_ours(fn),
                     "ours_unchunked": with_ours(fn, ("--prefill-chunk", "100000"))}
        report["workloads"].append(entry)
        print(json.dumps(entry, default=str), file=sys.stderr, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "report.md").write_text(markdown(report))
        print(f"report: {out / 'report.md'}", file=sys.stderr)
    return report


def markdown(report: dict) -> str:
    lines = [f"# Agent workloads ({report['date']}, {report['cpu']}, {report['threads']} threads)", "",
             f"Model: `{Path(report['model']).name}`; streaming chat completions, greedy.", ""]
    for w in report["workloads"]:
        name = w["workload"]
        if "ttft_ratio_later_calls_geomean" in w:
            lines += [f"## {name}", "", "| call | time to first token, speculant | llama-server |", "|---|---|---|"]
            lines += [f"| {i + 1} | {a:.2f} s | {b:.2f} s |"
                      for i, (a, b) in enumerate(zip(w["ours_ttft_s"], w["theirs_ttft_s"]))]
            lines += ["", f"- time to first token on calls 2…: **{w['ttft_ratio_later_calls_geomean']:.2f}×** "
                          "llama-server's (geometric mean)",
                      f"- whole wall time: speculant {w['ours_wall_s']:.1f} s, llama-server {w['theirs_wall_s']:.1f} s:"
                      f" **{w['wall_speedup']:.2f}×** faster",
                      f"- the same text as llama-server on {sum(w['same_text'])} of {len(w['same_text'])} calls", ""]
        else:
            lines += [f"## {name}", "", "```", json.dumps({k: v for k, v in w.items() if k != "workload"},
                                                          indent=1, default=str), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
