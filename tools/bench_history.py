"""The run summary of docs/history.md: one row per `speculant bench` report this repository has held,
read from its report.json as last committed (removed runs included, from history): the date, the commit that
wrote it, the CPU and kernel level, the model, and the headline at batch 1, greedy, all prompts.

    python tools/bench_history.py > /tmp/rows.md     # then paste between history.md's markers
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOB = "docs/benchmarks/*/report.json"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def reports() -> list[tuple[str, str]]:
    """(folder, commit) of every report.json ever committed, its last version (a removal is not a version)."""
    paths = sorted({p for p in git("log", "--format=", "--name-only", "--", GLOB).split() if p})
    return [(Path(p).parent.name, git("log", "-1", "--diff-filter=AM", "--format=%h", "--", p).strip())
            for p in paths]


def _x(v: float | None) -> str:
    return f"{v:.2f}×" if v else "–"


def headline(report: dict) -> str:
    """The best Speculant configuration over its plain decoding (code and chat beside it where run), and the
    peers' plain decoding against ours, at batch 1, greedy."""
    rows = [r for r in report["experiments"]["k"]["summary"] if r["batch_size"] == 1 and r["temperature"] == 0]
    alls = [r for r in rows if r["prompt_class"] == "all"]
    plain = next((r for r in alls if r["family"] == "speculant" and r["method"] is None), None)
    spec = [r for r in alls if r["family"] == "speculant" and r["method"] and r["speedup"]]
    parts = [f"plain {plain['tokens_per_s']:.1f} tok/s" if plain and plain["tokens_per_s"] else "plain –"]
    if spec:
        best = max(spec, key=lambda r: r["speedup"])
        by_class = {r["prompt_class"]: r["speedup"] for r in rows if r["runner"] == best["runner"]}
        classes = ", ".join(f"{c} {_x(by_class[c])}" for c in ("code", "chat") if by_class.get(c))
        parts.append(f"{best['method']} k={best['k']} **{_x(best['speedup'])}**" + (f" ({classes})" if classes else ""))
    for r in alls:
        if r["family"] != "speculant" and r["method"] is None and r.get("vs_speculant"):
            parts.append(f"ours plain {_x(1 / r['vs_speculant'])} {r['runner']}")
    return "; ".join(parts)


def row(folder: str, commit: str) -> tuple[str, str]:
    report = json.loads(git("show", f"{commit}:docs/benchmarks/{folder}/report.json"))
    meta = report["meta"]
    model = Path(meta.get("model") or "bundled").name.removesuffix(".gguf")
    cpu = f"{meta.get('cpu', '?')}, {meta.get('cpu_count', '?')} cores" + (
        f", {meta['kernel_level']}" if meta.get("kernel_level") else "")
    date = str(meta.get("started", "?"))[:10]
    return date, f"| {folder} | {date} | {commit} | {cpu} | {model} | {headline(report)} |"


def main() -> None:
    print("| run | date | commit | CPU | model | batch 1, greedy: plain; best configuration over it; peers |")
    print("|---|---|---|---|---|---|")
    for _, line in sorted(row(folder, commit) for folder, commit in reports()):
        print(line)


if __name__ == "__main__":
    main()
