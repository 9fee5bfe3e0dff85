"""Agent and chat workloads through the HTTP API, beside llama-server on the same GGUF file.

Agents and chat clients resend their whole conversation, or one long system prompt, at every call; what
they wait for is the first token of each call. Each workload runs streaming chat completions, greedy,
against `speculant serve` and `llama-server` (one slot, `cache_prompt` on, as its users run it), one
server after the other for each workload:

- conversation: a 6-turn coding conversation, each call the whole conversation so far;
- system: 5 calls sharing a ~660-token system prompt of tool descriptions, different questions;
- concurrent: 4 clients × 3 requests at once on a fresh server (no cost curve cached), aggregate tokens/s
  (llama-server with -np 4), beside the engine's own batch-4 throughput on the same requests (`LLM.chat`);
- long-prompt: 3 streams decode while a 4,000-token prompt arrives: the gaps between their steps while it is
  prefilled, against their gaps before it arrived (chunked prefill, and one pass for the whole prompt).

With `--clients N` (N > 1) the conversation and system workloads run N clients at once against speculant
alone (a fleet: `--serve-args "--replicas 2 --routing load"`), each its own conversation or its own order
of questions, and report the later calls' prefix-cache hit rate (the usage's cached prompt tokens) and first
tokens, and how often a later call reached the replica that served the call before it (docs/scale-out.md).
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

from speculant.arguments import whole_number
from speculant.bench.peers import LlamaServer, _free_port, _stop, llama_server_binary
from speculant.server.scaleout.replicas import REPLICA_HEADER, wait_for_replicas

WORKLOADS = ("conversation", "system", "concurrent", "long-prompt")
START_S = 900  # a fresh machine builds the kernels and measures the cost curve before the server answers


@dataclass
class Call:
    ttft_s: float
    total_s: float
    tokens: int  # completion tokens as the usage says, else the streamed content chunks
    text: str
    times: list[float] = field(default_factory=list)  # perf_counter() at each chunk
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (usage.prompt_tokens_details)
    replica: str | None = None  # the x-speculant-replica that answered, behind `serve --replicas`


def chat(url: str, messages: list[dict], max_tokens: int, model: str = "m", **extra) -> Call:
    """One streaming chat completion, greedy; `tokens` from the usage the server reports, else the chunks."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, times, n, usage = None, [], [], 0, None
    with urllib.request.urlopen(req, timeout=1200) as r:
        replica = r.headers.get(REPLICA_HEADER)
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            piece = choices[0].get("delta", {}).get("content") if choices else None
            if not piece:
                continue
            now = time.perf_counter()
            first = first or now
            times.append(now)
            text.append(piece)
            n += 1
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage and usage.get("completion_tokens") else n
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Call((first or end) - t0, end - t0, n, "".join(text), times, usage.get("prompt_tokens") or 0, cached,
                replica)


def replica_count(serve_args: tuple[str, ...]) -> int:
    """`--replicas N` (or `--replicas=N`) among serve's arguments; 1 without it."""
    for i, arg in enumerate(serve_args):
        if arg == "--replicas" and i + 1 < len(serve_args):
            return int(serve_args[i + 1])
        if arg.startswith("--replicas="):
            return int(arg.split("=", 1)[1])
    return 1


class SpeculantServer:
    """`speculant serve` as a user starts it, on a free loopback port."""

    def __init__(self, model: str, threads: int, n_ctx: int, extra: tuple[str, ...] = (),
                 env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "speculant.cli", "serve", "--model", model, "--threads", str(threads),
               "--max-model-len", str(n_ctx), "--port", str(self.port), "--served-model-name", "m", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        self.started_s = time.perf_counter()
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"speculant serve exited: {self.log.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"speculant serve did not answer /health within {START_S} s")
        # A fleet answers as soon as one replica does; the workload starts once the proxy routes to all.
        replicas = replica_count(extra)
        seen = wait_for_replicas(self.url, replicas, max(deadline - time.monotonic(), 1.0)) if replicas > 1 else {""}
        if len(seen) < replicas:
            raise RuntimeError(f"the proxy routes to {len(seen)} of {replicas} replicas after {START_S} s")
        self.started_s = time.perf_counter() - self.started_s

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


def at_once(clients: int, work) -> tuple[list[list[Call]], float]:
    """`work(c)` for each client c in its own thread → each client's calls, and the wall time."""
    results: list[list[Call]] = [[] for _ in range(clients)]

    def client(c: int) -> None:
        results[c] = work(c)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def fleet_conversations(url: str, turns: list[str], clients: int, max_tokens: int) -> tuple[list[list[Call]], float]:
    """`clients` conversations at once, each its own (its first message names it, so no two share a prefix
    beyond the chat template's)."""
    def one(c: int) -> list[Call]:
        return conversation(url, [f"(Project {c + 1}.) {turns[0]}", *turns[1:]], max_tokens)

    return at_once(clients, one)


def fleet_system(url: str, system: str, questions: list[str], clients: int,
                 max_tokens: int) -> tuple[list[list[Call]], float]:
    """`clients` agents sharing one system prompt, each asking the questions in its own order."""
    def one(c: int) -> list[Call]:
        return shared_system(url, system, questions[c % len(questions):] + questions[:c % len(questions)],
                             max_tokens)

    return at_once(clients, one)


def fleet_summary(name: str, clients: list[list[Call]], wall_s: float) -> dict:
    """Later calls (each client's second on): prefix-cache hit rate over their prompt tokens, first-token
    times, and the share that reached the replica of the client's call before."""
    first = [calls[0] for calls in clients]
    later = [c for calls in clients for c in calls[1:]]
    same = [b.replica == a.replica for calls in clients for a, b in zip(calls, calls[1:]) if a.replica]
    return {"workload": name, "clients": len(clients), "calls": len(first) + len(later), "wall_s": wall_s,
            "later_hit_rate": sum(c.cached_tokens for c in later) / max(sum(c.prompt_tokens for c in later), 1),
            "first_hit_rate": sum(c.cached_tokens for c in first) / max(sum(c.prompt_tokens for c in first), 1),
            "later_ttft_median_s": statistics.median(c.ttft_s for c in later),
            "later_ttft_mean_s": statistics.fmean(c.ttft_s for c in later),
            "first_ttft_median_s": statistics.median(c.ttft_s for c in first),
            "later_same_replica": sum(same) / len(same) if same else None,
            "replicas": sorted({c.replica for calls in clients for c in calls if c.replica}),
            "tokens": sum(c.tokens for calls in clients for c in calls)}


def concurrent(url: str, questions: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests one after the other → aggregate tokens/s."""
    def one(c: int) -> list[Call]:
        return [chat(url, [{"role": "user", "content": questions[(c * per_client + i) % len(questions)]}], max_tokens)
                for i in range(per_client)]

    results, wall = at_once(clients, one)
    calls = [call for calls in results for call in calls]
    tokens = sum(c.tokens for c in calls)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "median_latency_s": statistics.median(c.total_s for c in calls)}


def engine_batch(model: str, questions: list[str], batch: int, max_tokens: int, n_ctx: int, threads: int) -> dict:
    """The engine's own throughput on the same requests, `batch` at a time, in this process (`LLM.chat`): what
    the server's concurrent clients are held against."""
    import torch

    from speculant.config import SamplingParams
    from speculant.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(model, max_batch_size=batch, max_model_len=n_ctx)
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))  # first passes
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def fresh_cache() -> dict:
    """The environment of a freshly installed server: the cache holds the converted model files (a fresh
    machine makes them once, before the server answers) but no measured cost curve."""
    from speculant.models.gguf_file import cache_dir

    real, fresh = cache_dir(None), Path(tempfile.mkdtemp(prefix="speculant-fresh-"))
    for entry in real.iterdir() if real.is_dir() else []:
        if entry.name != "cost_curves":
            (fresh / entry.name).symlink_to(entry)
    return {**os.environ, "SPECULANT_CACHE": str(fresh)}


def step_spans(times: list[float], same_step_s: float = 0.002) -> list[tuple[float, float]]:
    """(start, end) of the waits between the steps that sent tokens: a speculative step streams its accepted
    tokens as chunks microseconds apart, which are one wait for the reader, not several."""
    steps = [t for i, t in enumerate(times) if i == 0 or t - times[i - 1] > same_step_s]
    return list(zip(steps, steps[1:]))


# Seconds the streams decode alone before the long prompt arrives: their median wait alone is read there, and
# adaptive k's choices move it from stretch to stretch, so a short stretch leaves the ratio to luck.
ALONE_S = 12.0


def long_prompt(url: str, questions: list[str], filler: str, max_tokens: int) -> dict:
    """3 streams decode; once they are under way a ~4,000-token prompt arrives. The waits between their steps
    while it is prefilled (from its arrival to its first token), against their waits before it arrived."""
    results: list[Call] = [None] * 3  # type: ignore[list-item]
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        started.wait()
        # ignore_eos: the streams must outlast the long prompt's prefill for the comparison to mean anything.
        results[i] = chat(url, [{"role": "user", "content": questions[i]}], max_tokens, ignore_eos=True)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(ALONE_S)  # the streams are decoding
    sent = time.perf_counter()
    arrival = chat(url, [{"role": "user", "content": filler + "\n\nSummarize the text above in one line."}], 8)
    prefilled = sent + arrival.ttft_s
    for t in threads:
        t.join()
    spans = [span for c in results for span in step_spans(c.times)]
    alone = [b - a for a, b in spans if b < sent]
    during = sorted(b - a for a, b in spans if b > sent and a < prefilled)
    median_alone = statistics.median(alone)
    p99 = during[int(0.99 * (len(during) - 1))] if during else float("nan")
    return {"step_wait_alone_median_s": median_alone, "steps_alone": len(alone), "step_wait_during_p99_s": p99,
            "step_wait_during_max_s": during[-1] if during else float("nan"),
            "p99_during_over_median_alone": p99 / median_alone, "steps_during": len(during),
            "long_prompt_ttft_s": arrival.ttft_s,
            "streams_outlasted_prefill": all(c.times[-1] > prefilled for c in results),
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
    p.add_argument("--threads", type=whole_number(1), default=os.cpu_count())
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--serve-args", default="", help="more `speculant serve` flags, one string")
    p.add_argument("--clients", type=int, default=1,
                   help="conversation and system: this many clients at once, speculant alone (default 1)")
    p.add_argument("--no-peer", action="store_true", help="speculant alone")
    p.add_argument("--out", "-o", default=None, help="write report.json and report.md here")


def run(args: argparse.Namespace) -> dict:
    from speculant.models.registry import named_model_path

    model_file = named_model_path(args.model) or Path(args.model)
    data = agent_prompts()
    binary = None if args.no_peer else llama_server_binary()
    report: dict = {"cpu": cpu_name(), "threads": args.threads, "model": str(model_file), "date": time.strftime("%F"),
                    "serve_args": args.serve_args, "workloads": []}
    ours_cmd = tuple(args.serve_args.split())

    def with_ours(fn, extra=(), env=None):
        server = SpeculantServer(args.model, args.threads, args.ctx, ours_cmd + tuple(extra), env)
        print(f"  speculant serve answered after {server.started_s:.0f} s", file=sys.stderr, flush=True)
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
    concurrent_questions = (data["questions"] + data["conversation"])[:12]
    workloads = {
        "conversation": lambda url: conversation(url, data["conversation"], args.max_tokens),
        "system": lambda url: shared_system(url, data["system"], data["questions"], args.max_tokens),
        "concurrent": lambda url: concurrent(url, concurrent_questions, 4, 3, 128),
        "long-prompt": lambda url: long_prompt(url, data["questions"], filler, 2048),
    }
    clients = getattr(args, "clients", 1)
    fleet = {
        "conversation": lambda url: fleet_conversations(url, data["conversation"], clients, args.max_tokens),
        "system": lambda url: fleet_system(url, data["system"], data["questions"], clients, args.max_tokens),
    }
    for w in args.workloads:
        print(f"workload {w} …", file=sys.stderr, flush=True)
        fn = workloads[w]
        if w in fleet and clients > 1:
            entry = fleet_summary(w, *with_ours(fleet[w]))
        elif w in ("conversation", "system"):
            ours, theirs = with_ours(fn), with_theirs(fn)
            entry = summarize(w, ours, theirs) if theirs else {"workload": w, "ours": [asdict(c) for c in ours]}
        elif w == "concurrent":
            entry = concurrent_entry(with_ours(fn, env=fresh_cache()), with_theirs(fn, slots=4),
                                     engine_batch(args.model, concurrent_questions, 4, 128, args.ctx, args.threads))
        else:
            entry = {"workload": w, "ours": with_ours(fn),
                     "ours_unchunked": with_ours(fn, ("--prefill-chunk", "0"))}
        report["workloads"].append(entry)
        print(json.dumps(entry, default=str), file=sys.stderr, flush=True)
    if args.out:
        write_report(report, Path(args.out))
    return report


def concurrent_entry(ours: dict, theirs: dict | None, engine: dict) -> dict:
    """4 clients at once: a fresh server of ours, llama-server with 4 slots, our engine at batch 4 without HTTP."""
    entry = {"workload": "concurrent", "ours_fresh_server": ours, "theirs_np4": theirs, "engine_batch4": engine,
             "ours_over_engine": ours["tokens_per_s"] / engine["tokens_per_s"]}
    if theirs:
        entry["ours_over_theirs"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return entry


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    print(f"report: {out / 'report.md'}", file=sys.stderr)


def markdown(report: dict) -> str:
    lines = [f"# Agent workloads ({report['date']}, {report['cpu']}, {report['threads']} threads)", "",
             f"Model: `{Path(report['model']).name}`; streaming chat completions, greedy; serve flags: "
             f"`{report.get('serve_args') or 'none'}`.", ""]
    for w in report["workloads"]:
        name = w["workload"]
        if "later_hit_rate" in w:
            same = w["later_same_replica"]
            lines += [f"## {name}: {w['clients']} clients at once ({w['calls']} calls)", "",
                      f"- later calls' prefix-cache hit rate **{w['later_hit_rate']:.1%}** (first calls "
                      f"{w['first_hit_rate']:.1%})",
                      f"- first token: later calls median {w['later_ttft_median_s']:.2f} s (mean "
                      f"{w['later_ttft_mean_s']:.2f} s), first calls median {w['first_ttft_median_s']:.2f} s",
                      f"- wall {w['wall_s']:.1f} s, {w['tokens']} tokens; replicas {len(w['replicas'])}"
                      + (f", later calls on the previous call's replica {same:.0%}" if same is not None else ""), ""]
        elif "ttft_ratio_later_calls_geomean" in w:
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
