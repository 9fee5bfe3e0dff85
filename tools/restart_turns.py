"""A restart in the middle of an agent's conversation: four turns against `speculant serve --prefix-cache-dir`,
the server stopped and started again on the same folder, the fifth turn sent; beside it the fifth turn on a
server that never stopped, and on a fresh server with no cache folder (cold). Reports each fifth turn's cached
prompt tokens and first-token time, and whether every answer is the same.

    python tools/restart_turns.py [--model M] [--rounds 3] [-- extra serve flags]

Each round starts its servers afresh. The restarted server and the cold one get one unrelated short request
before the fifth turn, so that what is timed is the turn, not the process's first request.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

SYSTEM = ("You are a coding agent working in a Python repository. You can read files, run tests and edit code. "
          "Think about the smallest change that fixes the problem, explain it in a sentence, then show the patch. "
          "The repository has a package `shop` with modules `cart.py`, `prices.py` and `tax.py`, and tests in "
          "`tests/`. Follow PEP 8, keep functions short, and never change a test to make it pass.")
TURNS = ["The test test_cart_total fails with 'expected 10.50, got 10.5'. What do you look at first?",
         "Here is cart.py:\n\ndef total(items):\n    return sum(i.price * i.qty for i in items)\n\nWhat is wrong?",
         "The tests compare strings made with str(). Should prices be Decimal?",
         "Write the patch for prices.py that rounds to cents.",
         "Now the tax test fails: 'expected 1.05, got 1.0500000001'. Fix it the same way."]


def serve(port: int, cache_dir: Path | None, model: str | None, extra: list[str], log: Path) -> subprocess.Popen:
    """`speculant serve` (this checkout's), its output appended to `log`, once it answers."""
    cmd = [sys.executable, "-c", "import sys; from speculant.cli import main; sys.exit(main())", "serve",
           "--port", str(port), *(["--model", model] if model else []),
           *(["--prefix-cache-dir", str(cache_dir)] if cache_dir else []), *extra]
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd[3:])}\n")
        out.flush()
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    for _ in range(1200):
        if server.poll() is not None:
            raise SystemExit(f"the server exited; its log: {log}")
        try:
            client.models.list()
            return server
        except Exception:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the server did not start in 10 minutes; its log: {log}")


def stop(server: subprocess.Popen) -> None:
    """SIGINT, as a user's Ctrl-C: the server drains and exits, its pending disk writes finished."""
    server.send_signal(signal.SIGINT)
    server.wait(120)


def turn(client: OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
    """One streamed turn → its text, first-token seconds, prompt tokens, cached prompt tokens."""
    start, first, text, usage = time.perf_counter(), None, "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - start
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return text, first or float("nan"), usage.prompt_tokens, details.cached_tokens if details else 0


def four_turns(client: OpenAI, model: str, max_tokens: int) -> tuple[list[dict], list[str]]:
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for text in TURNS[:4]:
        messages.append({"role": "user", "content": text})
        answers.append(turn(client, model, messages, max_tokens)[0])
        messages.append({"role": "assistant", "content": answers[-1]})
    return messages + [{"role": "user", "content": TURNS[4]}], answers


def warm_up(client: OpenAI, model: str) -> None:
    turn(client, model, [{"role": "user", "content": "Say hello."}], 4)


def one_round(args, root: Path) -> dict:
    port, extra, log = args.port, args.serve_flags, root / "servers.log"
    root.mkdir(parents=True, exist_ok=True)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    result = {}
    # A server that never stops: four turns, then the fifth.
    server = serve(port, root / "stays", args.model, extra, log)
    try:
        model = client.models.list().data[0].id
        fifth, stay_answers = four_turns(client, model, args.max_tokens)
        result["stays"] = turn(client, model, fifth, args.max_tokens)
    finally:
        stop(server)
    # Four turns, a stop, a start on the same folder, the fifth turn.
    server = serve(port, root / "restarts", args.model, extra, log)
    try:
        fifth_r, restart_answers = four_turns(client, model, args.max_tokens)
    finally:
        stop(server)
    server = serve(port, root / "restarts", args.model, extra, log)
    try:
        warm_up(client, model)
        result["restarted"] = turn(client, model, fifth_r, args.max_tokens)
    finally:
        stop(server)
    # Cold: a fresh server with no folder, the fifth turn alone.
    server = serve(port, None, args.model, extra, log)
    try:
        warm_up(client, model)
        result["cold"] = turn(client, model, fifth, args.max_tokens)
    finally:
        stop(server)
    result["same"] = (stay_answers == restart_answers and fifth == fifth_r
                      and len({r[0] for r in (result["stays"], result["restarted"], result["cold"])}) == 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="what `serve` loads (default: the bundled model)")
    ap.add_argument("--port", type=int, default=8439)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--keep", default=None, help="keep the cache folders under this path")
    ap.add_argument("serve_flags", nargs="*", help="after --: more `serve` flags (e.g. --threads 2)")
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        root = Path(args.keep) / f"round{r}" if args.keep else Path(tempfile.mkdtemp(prefix="restart_turns-"))
        try:
            rounds.append(one_round(args, root))
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    for name in ("stays", "restarted", "cold"):
        firsts = [r[name][1] for r in rounds]
        _, _, prompt, cached = rounds[-1][name]
        print(f"turn 5, {name:9s}: {cached:5d} of {prompt} prompt tokens cached; first token median "
              f"{statistics.median(firsts) * 1000:7.0f} ms (n={len(firsts)}, min {min(firsts) * 1000:.0f}, "
              f"max {max(firsts) * 1000:.0f})")
    ratio = [r["restarted"][1] / r["stays"][1] for r in rounds]
    print(f"restarted / never stopped: {statistics.median(ratio):.2f}x (median of {len(ratio)})")
    print("answers identical (turns 1-5, all three servers):", all(r["same"] for r in rounds))


if __name__ == "__main__":
    main()
