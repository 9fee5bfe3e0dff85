"""First token of a conversation's later turns: chat completions (the messages resent) against the Responses API
(`previous_response_id`), interleaved, on the bundled model. Both prompts should start from the prefix cache.

    python tools/responses_ttft.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import time

from openai import OpenAI

PORT = 8437
SYSTEM = "You are a concise programming tutor."
TURNS = ["Explain what a hash map is.", "How does it handle collisions?", "Show a tiny Python example.",
         "What is its complexity?", "When would a tree map be better?", "Summarize in one line."]


def chat_turns(client: OpenAI, model: str) -> list[float]:
    messages, waits = [{"role": "system", "content": SYSTEM}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        start, first, text = time.perf_counter(), None, ""
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                                    stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                text += chunk.choices[0].delta.content
        waits.append(first)
        messages.append({"role": "assistant", "content": text})
    return waits[1:]


def response_turns(client: OpenAI, model: str) -> list[float]:
    previous, waits = None, []
    for turn in TURNS:
        start, first = time.perf_counter(), None
        with client.responses.stream(model=model, input=turn, instructions=SYSTEM, previous_response_id=previous,
                                     max_output_tokens=48, temperature=0) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    first = first or time.perf_counter() - start
            previous = stream.get_final_response().id
        waits.append(first)
    return waits[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    server = subprocess.Popen(["speculant", "serve", "--port", str(PORT), "--threads", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused")
        for _ in range(300):
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                time.sleep(1)
        waits: dict[str, list[float]] = {"chat": [], "responses": []}
        ways = [("chat", chat_turns), ("responses", response_turns)]
        for r in range(rounds):
            for name, run in ways if r % 2 == 0 else ways[::-1]:
                waits[name] += run(client, model)
        for name, w in waits.items():
            print(f"{name}: later turns' first token median {statistics.median(w) * 1000:.0f} ms "
                  f"(n={len(w)}, min {min(w) * 1000:.0f}, max {max(w) * 1000:.0f})")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)


if __name__ == "__main__":
    main()
