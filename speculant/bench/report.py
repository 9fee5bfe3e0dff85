"""The report of a benchmark: Markdown for people, JSON for machines, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from speculant.bench.cost import cost_line, saving
from speculant.bench.suite import BenchResult, cost_table
from speculant.bench.summary import ALL, Row
from speculant.speedup import MEMORY_BOUND_RATIO, CostCurve

PLOTS = {
    "speedup_vs_batch": "speed-up vs batch size",
    "speedup_vs_k": "speed-up vs k",
    "per_position_acceptance": "per-position acceptance",
    "cost_curve": "cost curve C(T)/C(1)",
}


def write_report(result: BenchResult, out: Path, with_json: bool = True) -> dict[str, Path]:
    """report.md, report.json and one PNG per plot under `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"markdown": out / "report.md"}
    if with_json:
        files["json"] = out / "report.json"
        files["json"].write_text(json.dumps(result.as_dict(), indent=1, default=_jsonable) + "\n")
    for name, path in write_plots(result, out).items():
        files[name] = path
    files["markdown"].write_text(markdown(result))
    return files


def _jsonable(x):
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} to JSON")


# -- formatting ------------------------------------------------------------------------------


def _x(v: float | None) -> str:
    return f"{v:.2f}×" if v else "–"


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f}%" if v is not None else "–"


def _num(v: float | None, digits: int = 1) -> str:
    return f"{v:.{digits}f}" if v is not None else "–"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _speedup_cell(r: Row) -> str:
    if not r.speedup:
        return "–"
    if r.speedup_iqr and r.jobs > 1:
        return f"{r.speedup:.2f}× ({r.speedup_iqr[0]:.2f}–{r.speedup_iqr[1]:.2f})"
    return f"{r.speedup:.2f}×"


def _weights(quantization: str | None) -> str:
    return {"int8": "int8 (per channel)", "int4": "int4 (groups of 32)",
            "gguf": "the GGUF file's own blocks"}.get(quantization or "", "unquantized")


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def _ms(seconds: float | None) -> str:
    return f"{1000 * seconds:.0f}" if seconds is not None else "–"


def _split(r: Row) -> str:
    s = r.time_split
    return f"{_pct(s['draft'])} / {_pct(s['target'])} / {_pct(s['other'])}" if s else "–"


# -- the Markdown report ------------------------------------------------------------------------


def markdown(result: BenchResult) -> str:
    m, plan = result.meta, result.plan
    model = Path(m["model"]).name
    parts = [
        f"# Speculant benchmark: {model}\n",
        f"{m['started']}, {m['duration_s'] / 60:.1f} min. Machine: {m['cpu']}, {m['cpu_count']} cores"
        f"{', kernel level ' + m['kernel_level'] if 'kernel_level' in m else ''}, "
        f"PyTorch {m['torch']} ({_threads(m['torch_threads'])}), {m['device']}, {m['dtype']}, "
        f"weights: {_weights(m.get('quantization'))}, "
        f"{m['params'] / 1e6:.3g}M parameters. Load average {m['load_average_start']} at the start, "
        f"{m['load_average_end']} at the end.\n",
        "> Measured on a shared machine: other work competes for the same cores, so absolute tokens/s "
        "move from minute to minute. Every configuration runs the same prompts interleaved "
        "(A B C, B C A, …) in one process and is reported as a ratio to the plain run of the same "
        "prompts; the range after a speed-up is the interquartile range of the per-prompt paired ratios."
        + (" PyTorch ran on fewer threads than the machine has cores: with other jobs on the same cores, "
           "the threads of one process would wait for each other at every operation."
           if m["torch_threads"] < (m["cpu_count"] or 1) else "") + "\n",
        f"Command: `{m['command']}`  \n{m['prompts']} prompts ({', '.join(m['prompt_classes'])}), up to "
        f"{plan.max_tokens} output tokens each, stopping at end of sequence."
        + (" **Repeated requests** (`--repeat`): every configuration decoded each batch of prompts once, "
           "untimed, right before its timed run." if plan.repeat else "") + "\n",
    ]
    parts += headline(result)
    parts += regime_section(result)
    parts += k_section(result)
    parts += batch_section(result)
    parts += temperature_section(result)
    parts += peers_section(result)
    parts += cost_section(result)
    parts += method_section(result)
    return "\n".join(parts)


def headline_table(result: BenchResult) -> str:
    """Per prompt class at batch 1, greedy: plain tokens/s, each proposer at its best k, the peers'
    speculative modes against their own plain decoding."""
    rows = result.experiments["k"].rows
    classes = list(dict.fromkeys(r.prompt_class for r in rows if r.prompt_class != ALL)) + [ALL]
    methods = list(dict.fromkeys(r.method for r in rows if r.family == "speculant" and r.method))
    peers = list(dict.fromkeys(r.runner for r in rows if r.family != "speculant" and r.method))
    header = ["prompts", "plain tok/s"] + [f"{m} (best k)" for m in methods] + peers
    body = []
    for c in classes:
        in_class = [r for r in rows if r.prompt_class == c]
        plain = next((r for r in in_class if r.family == "speculant" and r.method is None), None)
        line = [c, _num(plain.tokens_per_s if plain else None)]
        for method in methods:
            cands = [r for r in in_class if r.method == method and r.speedup]
            best = max(cands, key=lambda r: r.speedup, default=None)
            line.append(f"**{best.speedup:.2f}×** (k={best.k})" if best else "–")
        for p in peers:
            r = next((r for r in in_class if r.runner == p), None)
            line.append(_x(r.speedup) if r else "–")
        body.append(line)
    return _table(header, body)


def headline(result: BenchResult) -> list[str]:
    out = ["## Headline: speed-up at batch 1, greedy\n",
           "Decode tokens/s of each configuration over plain decoding (k = 0) on the same prompts; peers "
           "over their own plain decoding.\n", headline_table(result)]
    out.append(f"**Regime:** {result.regime()['verdict']}.\n")
    cost = headline_cost(result)
    if cost:
        out.append(f"**Cost:** {cost}.\n")
    if result.notes:
        out.append("Notes: " + "; ".join(result.notes) + ".\n")
    return out


def regime_section(result: BenchResult) -> list[str]:
    curve, reg = result.curve, result.regime()
    widths = list(range(1, curve.max_width + 1))
    body = [[str(t)] + [f"{curve.ratio(b, t):.2f}" for b in curve.batch_sizes] for t in widths]
    base = [["C(1) ms"] + [f"{1000 * curve.cost(b, 1):.1f}" for b in curve.batch_sizes],
            ["free width"] + [str(reg["free_width"][b]) for b in curve.batch_sizes]]
    if result.meta.get("weight_bytes"):  # how near one pass runs to the memory's speed
        base.insert(1, ["C(1) as weights GB/s"] + [f"{result.meta['weight_bytes'] / curve.cost(b, 1) / 1e9:.1f}"
                                                   for b in curve.batch_sizes])
    return [
        "## Regime: is the target memory-bound?\n",
        f"{reg['verdict']}.\n",
        f"The {reg['rule']}. The free width is the widest pass (1 + k tokens per sequence) that costs at "
        f"most {MEMORY_BOUND_RATIO}× a plain pass. Cost of one target pass over T new tokens per sequence, "
        f"with {curve.context} tokens already cached, logits for every position (as a verify pass), "
        "relative to T = 1, per batch size B:\n",
        _table(["T"] + [f"B={b}" for b in curve.batch_sizes], base + body),
        "![cost curve](cost_curve.png)\n",
    ]


def _config_rows(rows: list[Row], with_peers: bool = False) -> list[list[str]]:
    body = []
    for r in rows:
        if r.family != "speculant" and not with_peers:
            continue
        body.append([r.prompt_class, r.runner, _num(r.tokens_per_s), _speedup_cell(r),
                     _x(r.predicted_speedup), _pct(r.acceptance_rate), _num(r.mean_acceptance_length, 2),
                     _pct(r.coverage), _pct(r.identical), _ms(r.ttft_s), _split(r), _cost(r)])
    return body


def _cost(r: Row) -> str:
    if r.draft_ms is None and r.pass_ratio is None:
        return "–"
    draft = "–" if r.draft_ms is None else f"{r.draft_ms:.1f}"
    return f"{draft} · {_x(r.pass_ratio)}"


CONFIG_HEADER = ["prompts", "configuration", "tok/s", "speed-up", "predicted", "acceptance",
                 "mean acc. length", "drafting steps", "identical", "TTFT ms", "draft / target / other",
                 "draft ms/token · pass/plain pass"]


def k_section(result: BenchResult) -> list[str]:
    rows = result.experiments["k"].rows
    return ["## Speed-up vs k (batch 1, greedy)\n",
            _table(CONFIG_HEADER, _config_rows(rows)),
            "![speed-up vs k](speedup_vs_k.png) ![per-position acceptance](per_position_acceptance.png)\n"]


def batch_section(result: BenchResult) -> list[str]:
    rows = [r for r in result.experiments["batch"].rows if r.prompt_class == ALL]
    body = [[str(r.batch_size)] + line[1:] for r, line in zip(rows, _config_rows(rows))]
    return ["## Speed-up vs batch size (greedy, all prompts)\n",
            "Total decode tokens/s of B sequences decoded together; predicted: the speed-up model with "
            "this run's measured acceptance and the cost curve at this batch size.\n",
            _table(["B"] + CONFIG_HEADER[1:], body),
            "![speed-up vs batch size](speedup_vs_batch.png)\n"]


def temperature_section(result: BenchResult) -> list[str]:
    exp = result.experiments.get("temperature")
    if not exp:
        return []
    rows = exp.rows
    body = [[_num(r.temperature, 1)] + line for r, line in zip(rows, _config_rows(rows))]
    return ["## Sampling (batch 1)\n",
            "Each request has its own seed, the same in every configuration, and a seeded request writes "
            "plain decoding's tokens with every proposer (\"identical\"): a draft model's drafts for it are "
            "drawn as plain decoding draws and kept while they match (coupling), so these rates are a seeded "
            "request's; an unseeded one's drafts are judged by the acceptance rule.\n",
            _table(["temperature"] + CONFIG_HEADER, body)]


def peers_section(result: BenchResult) -> list[str]:
    rows = [r for r in result.experiments["k"].rows if r.family != "speculant"]
    if not rows:
        return ["## Peers\n", "No peer ran: " + "; ".join(result.notes) + ".\n"]
    body = [[r.prompt_class, r.runner, _num(r.tokens_per_s), _x(r.speedup) if r.method else "–",
             _x(r.vs_speculant), _pct(r.identical) if r.method else "–", _ms(r.ttft_s)] for r in rows]
    header = ["prompts", "peer", "tok/s", "vs own plain", "vs Speculant plain", "identical", "TTFT ms"]
    return ["## Peers: same weights, same prompts, same run (batch 1, greedy)\n",
            "\"vs own plain\": the peer's speculative mode over its own plain greedy decoding; \"vs "
            "Speculant plain\": its tokens/s over Speculant's k = 0 on the same prompts; \"identical\": the "
            "share of prompts where its speculative output equals its own plain greedy output. llama.cpp "
            "runs the GGUF's quantized weights with its own kernels; transformers runs them dequantized; "
            "Speculant at the precision the header names (int4 and int8: the file's own grid).\n",
            _table(header, body)]


def _usd(v: float) -> str:
    return f"${v:.3f}"


def cost_section(result: BenchResult) -> list[str]:
    table = cost_table(result)
    if not table:
        return []
    plain = {t["batch_size"]: t for t in table if t["runner"] == "speculant k=0"}
    body = []
    for t in table:
        if t["runner"] == "speculant k=0":
            continue
        usd = t["usd_per_million_tokens"]
        base = plain[t["batch_size"]]["usd_per_million_tokens"] if t["batch_size"] in plain else None
        body.append([str(t["batch_size"]), t["runner"], _usd(base) if base else "–", _usd(usd),
                     _pct(saving(base, usd)) if base else "–"])
    basis = ("whole requests' time, prompt prefill included" if table[0]["rate"] == "end to end"
             else "decode time (this report predates whole-request rates)")
    return [f"## Cost per million generated tokens at ${result.plan.price_per_hour:g}/hour\n",
            f"The machine's price over the tokens it writes an hour, from {basis}; `--render` with "
            "`--price-per-hour` rewrites it at another price.\n",
            _table(["B", "configuration", "plain", "speculating", "saving"], body)]


def headline_cost(result: BenchResult) -> str | None:
    """At batch 1, greedy: plain decoding's cost per million generated tokens beside each proposer's at its best
    k (whole requests' rates), or None where the report has no price or no such rates."""
    price = result.plan.price_per_hour
    rows = [r for r in result.experiments["k"].rows if r.prompt_class == ALL and r.family == "speculant"]
    plain = next((r for r in rows if r.method is None), None)
    if not price or plain is None or not plain.e2e_tokens_per_s:
        return None
    best: dict[str, Row] = {}
    for r in rows:
        if r.method and r.speedup and r.e2e_tokens_per_s and (r.method not in best
                                                               or r.speedup > best[r.method].speedup):
            best[r.method] = r
    others = [(f"{m} k={r.k}", r.e2e_tokens_per_s) for m, r in best.items()]
    return cost_line(price, plain.e2e_tokens_per_s, others, "batch 1, greedy, whole requests")


def method_section(result: BenchResult) -> list[str]:
    return ["## How these numbers are made\n",
            "- **tok/s**: output tokens after the first step over the time after it (the first step, prefill "
            "and a first verify, is the TTFT), summed over the prompts of the row.\n"
            "- **speed-up**: tok/s over the plain run of the same prompts in the same sweep; **identical**: "
            "share of prompts whose output equals the plain output token for token (sampled: with each request's "
            "seed).\n"
            "- **acceptance**: accepted / drafted tokens; **mean acc. length**: 1 + accepted per drafting "
            "step; **drafting steps**: share of sequence-steps that carried a draft (prompt lookup drafts "
            "only when it finds a match).\n"
            "- **predicted**: docs/design.md §3, S = E / (C(k+1)/C(1) + k·c_draft/C(1)) with E = (1 − α^(k+1)) / "
            "(1 − α); α fitted so that E equals the measured mean acceptance length, C from the cost curve "
            "above, c_draft from the measured draft time; steps without a draft count as plain steps. "
            "The model leaves out the engine's own per-step work (verify, commit: the \"other\" share).\n"
            "- **draft ms/token · pass/plain pass**: engine time proposing per drafted token; the target's mean "
            "verify pass (steps with drafts) over the plain run's one-token pass: C(k+1)/C(1) as this run met it.\n"
            "- **draft / target / other**: shares of engine time proposing, in the target's forward pass, "
            "and verifying/committing.\n"]


# -- plots ------------------------------------------------------------------------------------


def write_plots(result: BenchResult, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {
        "speedup_vs_batch": _plot_speedup_vs_batch,
        "speedup_vs_k": _plot_speedup_vs_k,
        "per_position_acceptance": _plot_per_position,
        "cost_curve": _plot_cost_curve,
    }
    paths = {}
    for name, draw in drawn.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
        draw(result, ax)
        ax.grid(alpha=0.3)
        ax.set_title(PLOTS[name])
        if ax.get_legend_handles_labels()[0]:  # beside the axes: inside, it hides the lines
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], bbox_inches="tight")
        plt.close(fig)
    return paths


def _plot_speedup_vs_batch(result: BenchResult, ax) -> None:
    rows = [r for r in result.experiments["batch"].rows if r.prompt_class == ALL and r.method]
    for name in dict.fromkeys(r.runner for r in rows):
        mine = sorted((r for r in rows if r.runner == name), key=lambda r: r.batch_size)
        sizes = [r.batch_size for r in mine]
        line, = ax.plot(sizes, [r.speedup for r in mine], "o-", label=f"{name} measured")
        ax.plot(sizes, [r.predicted_speedup for r in mine], "--", color=line.get_color(),
                label=f"{name} predicted")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speed-up over plain decoding")


def _styles(rows: list[Row]) -> tuple[dict, dict]:
    """A colour per proposer, a line style per prompt class (all prompts: thick and solid)."""
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r.method for r in rows))}
    dashes = ["--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
    classes = [c for c in dict.fromkeys(r.prompt_class for r in rows) if c != ALL]
    lines = {ALL: dict(ls="-", lw=2.6)} | {c: dict(ls=dashes[i % len(dashes)], lw=1.2)
                                           for i, c in enumerate(classes)}
    return colors, lines


def _plot_speedup_vs_k(result: BenchResult, ax) -> None:
    rows = [r for r in result.experiments["k"].rows if r.family == "speculant" and r.method and r.speedup]
    colors, lines = _styles(rows)
    for method in colors:
        for cls in lines:
            mine = sorted((r for r in rows if r.method == method and r.prompt_class == cls),
                          key=lambda r: r.k)
            if mine:
                ax.plot([r.k for r in mine], [r.speedup for r in mine], marker="o", color=colors[method],
                        label=f"{method}, {cls}", **lines[cls])
    ax.axhline(1, color="grey", lw=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speed-up over plain decoding")


def _plot_per_position(result: BenchResult, ax) -> None:
    rows = [r for r in result.experiments["k"].rows if r.family == "speculant" and r.per_position_acceptance]
    colors, lines = _styles(rows)
    for method in colors:
        widest = max(r.k for r in rows if r.method == method)
        for r in rows:
            if r.method == method and r.k == widest:
                pp = r.per_position_acceptance
                ax.plot(range(1, len(pp) + 1), pp, marker="o", color=colors[method],
                        label=f"{method} k={widest}, {r.prompt_class}", **lines[r.prompt_class])
    ax.set_ylim(0, 1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (drafted at this position → accepted)")


def _plot_cost_curve(result: BenchResult, ax) -> None:
    curve: CostCurve = result.curve
    widths = range(1, curve.max_width + 1)
    for b in curve.batch_sizes:
        ax.plot(widths, [curve.ratio(b, t) for t in widths], "o-", ms=3, label=f"B={b}")
    ax.axhline(MEMORY_BOUND_RATIO, color="grey", ls="--", lw=0.8, label=f"{MEMORY_BOUND_RATIO}× (rule)")
    ax.set_xlabel("T (tokens per sequence in one pass)")
    ax.set_ylabel("C(T) / C(1)")
