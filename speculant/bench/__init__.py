"""Side-by-side benchmarks (`speculant bench`), regime analysis and advice (`speculant advise`).

regime.py    the target's cost curve C(T) and the speed-up model of docs/design.md §3
runner.py    timed runs of engines and peers, interleaved
peers.py     transformers and llama.cpp on the same weights (optional)
prompts.py   the shipped prompt classes and user JSONL
suite.py     the sweeps; summary.py the numbers; report.py Markdown, JSON, plots
"""
