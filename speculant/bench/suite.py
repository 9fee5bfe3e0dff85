"""A whole benchmark: the cost curve, then the sweeps, each interleaved on one loaded target.

Sweeps are slices through one default point (batch 1, greedy), not a full product that no
2-core machine could finish:
  k          batch 1, greedy: plain vs every proposer at every k, and the peers
  batch      greedy: plain vs each proposer at its best k from the k sweep, at every batch size
  temperature  batch 1: the same at each temperature above 0 (a fixed seed per request)
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from speculant.bench.cost import DEFAULT_PRICE_PER_HOUR, usd_per_million
from speculant.bench.peers import llama_cpp_peers, llama_server_peers, transformers_peers
from speculant.bench.precisions import weight_bytes
from speculant.bench.prompts import PROMPT_CLASSES, BenchPrompt, load_prompts
from speculant.bench.regime import memory_bound_limit, regime_rule, regime_verdict
from speculant.bench.runner import (
    EngineRunner,
    Job,
    Measurement,
    Runner,
    config_name,
    engine_runner,
    run_jobs,
    spec_method,
    warm_up,
)
from speculant.bench.summary import ALL, Row, summarize
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.defaults import TREE_WIDTH
from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.gguf_file import cache_dir
from speculant.models.loader import LoadedModel, load_model, resolve_model_path
from speculant.proposers.corpus import FILE as CORPUS_FILE
from speculant.speedup import CostCurve, measure_cost_curve

PROPOSERS = ("ngram", "ngram+corpus", "ngram+history", "ngram+corpus+history", "draft_model", "eagle",
             "draft_model+lookup", "draft_model+tree", "draft_model+lookup+tree", "eagle+lookup", "eagle+tree",
             "eagle+lookup+tree", "eagle+lookup+corpus+tree", "eagle3", "eagle3+lookup", "eagle3+tree",
             "eagle3+lookup+tree", "mtp", "mtp+lookup")
# The +history proposers' answer history (proposers/history.py): ~220 MB at most.
HISTORY_TOKENS = 1_000_000
DEFAULT_PROPOSERS = ("ngram", "ngram+corpus", "draft_model", "eagle", "eagle3")
PEERS = ("transformers", "llama.cpp", "llama-server")
DRAFTS_DIR = Path(__file__).resolve().parents[1] / "data" / "drafts"
# Drafts too large to ship (the bundled model's distilled draft) are made by `speculant train-draft` into here.
MADE_DRAFTS_DIR = cache_dir(None) / "drafts"


@dataclass
class BenchPlan:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None  # PyTorch CPU threads; None: PyTorch's default
    quantization: str | None = None  # int8 | int4 | auto: weight-only quantization of target and drafts
    draft_model: str | None = None
    eagle: str | None = None
    eagle3: str | None = None  # an EAGLE-3 head folder (any dialect)
    mtp: str | None = None  # an MTP-only GGUF beside the target; the target's own MTP layer where None
    corpus: str | None = None
    proposers: list[str] = field(default_factory=lambda: list(DEFAULT_PROPOSERS))
    tree_width: int = TREE_WIDTH  # of the +tree proposers' draft trees
    ks: list[int] = field(default_factory=lambda: [2, 4, 6, 8])
    batch_k: int | None = None  # None: each proposer's best k from the k sweep
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    prompts: list[str] = field(default_factory=lambda: list(PROMPT_CLASSES))
    per_class: int | None = 6
    max_tokens: int = 128
    max_prompt_tokens: int = 384
    chat: bool = True
    reps: int = 1
    repeat: bool = False  # decode each batch of prompts once untimed before its timed run (repeated requests)
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    peer_k: int = 4
    adaptive: bool = True  # also run each proposer with adaptive k (up to the largest k swept)
    cost_batch_sizes: list[int] | None = None  # None: the batch sweep's sizes
    max_width: int = 16
    cost_reps: int = 3
    price_per_hour: float | None = DEFAULT_PRICE_PER_HOUR  # dollars; None in reports written before it
    seed: int = 0
    progress: bool = True
    command: str = ""  # as typed, for the report


@dataclass
class Experiment:
    name: str
    description: str
    runners: list[Runner]
    measurements: list[Measurement] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"description": self.description, "runners": [r.describe() for r in self.runners],
                "summary": [r.as_dict() for r in self.rows],
                "measurements": [m.as_dict() for m in self.measurements]}


@dataclass
class BenchResult:
    plan: BenchPlan
    meta: dict
    curve: CostCurve
    experiments: dict[str, Experiment]
    notes: list[str]  # skipped proposers and peers, one line each

    def regime(self) -> dict:
        return {"verdict": regime_verdict(self.curve), "rule": regime_rule(),
                "memory_bound_up_to": memory_bound_limit(self.curve),
                "free_width": {b: self.curve.free_width(b) for b in self.curve.batch_sizes}}

    def as_dict(self) -> dict:
        return {"meta": self.meta, "plan": asdict(self.plan), "notes": self.notes, "regime": self.regime(),
                "cost_curve": self.curve.as_dict(), "cost": cost_table(self),
                "experiments": {n: e.as_dict() for n, e in self.experiments.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> BenchResult:
        """Back from report.json, summaries only (the raw runs are not needed to render a report)."""
        experiments = {
            name: Experiment(name, e["description"],
                             [Runner(r["name"], r["family"], r["method"], r["k"], r["reference"],
                                     extra_nodes=r.get("extra_nodes", 0)) for r in e["runners"]],
                             rows=[Row(**row) for row in e["summary"]])
            for name, e in d["experiments"].items()}
        return cls(BenchPlan(**d["plan"]), d["meta"], CostCurve.from_dict(d["cost_curve"]), experiments,
                   d["notes"])


def machine_facts() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__,
             "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
             "platform": platform.platform(), "load_average_start": _load_average(),
             "kernel_level": native.level()}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def shipped_drafts() -> dict[str, Path]:
    """Drafts for the bundled model, shipped under speculant/data/drafts/ or made into the cache's drafts/, found
    by their files: an EAGLE head has eagle_config.json, a draft model config.json, each beside its safetensors; a
    corpus table is its file."""
    found: dict[str, Path] = {}
    for root in (DRAFTS_DIR, MADE_DRAFTS_DIR):
        if not root.is_dir():
            continue
        for config in sorted(root.rglob("*config.json")):
            folder = config.parent
            if config.name == "eagle_config.json" and (folder / "eagle.safetensors").exists():
                found.setdefault("eagle", folder)
            elif config.name == "config.json" and (folder / "model.safetensors").exists():
                found.setdefault("eagle3" if is_eagle3_head(config) else "draft_model", folder)
        for table in sorted(root.rglob(CORPUS_FILE)):
            found.setdefault("corpus", table)
    return found


def is_eagle3_head(config: Path) -> bool:
    """Whether a config.json is an EAGLE-3 head's (proposers/eagle3.py's dialects), not a draft model's."""
    from speculant.proposers.eagle3 import SPECFORGE_ARCHITECTURES, SPECULATORS_ARCHITECTURES

    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a in SPECFORGE_ARCHITECTURES + SPECULATORS_ARCHITECTURES for a in archs)


def draft_paths(plan: BenchPlan) -> dict[str, Path | None]:
    """The draft model and EAGLE head to use: the user's, else those shipped for the bundled model."""
    drafts = shipped_drafts() if plan.model is None else {}
    return {"draft_model": resolve_model_path(plan.draft_model) if plan.draft_model else drafts.get("draft_model"),
            "eagle": Path(plan.eagle) if plan.eagle else drafts.get("eagle"),
            "eagle3": Path(plan.eagle3) if plan.eagle3 else drafts.get("eagle3"),
            "corpus": Path(plan.corpus) if plan.corpus else drafts.get("corpus")}


def missing_draft(kind: str) -> str:
    """Why a proposer that needs a draft of this kind cannot run, and how to get one."""
    flag = {"draft_model": "--draft-model", "eagle": "--eagle", "eagle3": "--eagle3", "corpus": "--corpus"}[kind]
    why = f"no {kind.replace('_', ' ')} given ({flag} PATH) or shipped under speculant/data/drafts/"
    if kind == "draft_model":
        # The bundled model's distilled draft (30 MB) is not shipped: its recipe is, and the bench finds what it makes.
        why += (" (make the bundled model's distilled draft, ~30 min: see "
                f"speculant/data/drafts/smollm2-135m-instruct/draft_model/README.md; it goes to {MADE_DRAFTS_DIR})")
    return why


def proposer_configs(plan: BenchPlan, k: int) -> tuple[list[SpeculativeConfig], list[str]]:
    """The speculative configurations the plan asks for at this k, and why any is left out."""
    paths = draft_paths(plan)
    configs, notes = [], []
    for name in plan.proposers:
        method, *options = name.split("+")
        needed = [d for d in (method, *options) if d in ("draft_model", "eagle", "eagle3", "corpus")
                  and not paths.get(d)]
        if needed:
            notes.append(f"{name} skipped: {missing_draft(needed[0])}")
            continue
        config = {"method": method, "num_speculative_tokens": k}
        if "corpus" in options:
            config["corpus"] = str(paths["corpus"])
        if "history" in options:
            config["history_tokens"] = HISTORY_TOKENS
        if method == "mtp":  # the target's own layer, or an MTP-only file beside it
            config |= {"lookup_first": "lookup" in options} | ({"model": plan.mtp} if plan.mtp else {})
        elif method != "ngram":
            config |= {"model": str(paths[method]), "lookup_first": "lookup" in options,
                       "tree_width": plan.tree_width if "tree" in options else 1}
        config |= draft_options(options)
        configs.append(SpeculativeConfig.parse(config))
    return configs, notes


def draft_options(options: list[str]) -> dict:
    """A proposer name's draft options: vocabN (draft_vocab_size), pminX (draft_p_min), pchainX (draft_p_chain),
    q4_0 (draft_quantization)."""
    out = {"draft_quantization": "q4_0"} if "q4_0" in options else {}
    for option in options:
        for prefix, key, kind in (("vocab", "draft_vocab_size", int), ("pmin", "draft_p_min", float),
                                  ("pchain", "draft_p_chain", float)):
            if option.startswith(prefix) and option != prefix:
                try:
                    out[key] = kind(option[len(prefix):])
                except ValueError:
                    raise SpeculantError(f"proposer option {option!r}: {prefix} takes a number") from None
    return out


def without_draft_options(name: str) -> str:
    """draft_model+lookup+vocab32768+pmin0.6 → draft_model+lookup."""
    return "+".join(o for o in name.split("+") if not re.fullmatch(r"(vocab\d+|pmin[0-9.]+|pchain[0-9.]+|q4_0)", o))


def adaptive_configs(plan: BenchPlan) -> list[SpeculativeConfig]:
    """Each proposer with adaptive k, up to the largest k of the sweep."""
    if not plan.adaptive:
        return []
    return [replace(c, adaptive=True) for c in proposer_configs(plan, max(plan.ks))[0]]


def try_runner(target: LoadedModel, spec: SpeculativeConfig | None, batch: int, max_len: int,
               notes: list[str]) -> EngineRunner | None:
    """An engine runner, or None with a note when this build cannot run the proposer."""
    try:
        runner = engine_runner(target, spec, batch, max_len)
        mapping = runner.engine.proposer.vocab_mapping if runner.engine.proposer else None
        if mapping and spec is not None:
            notes.append(f"{spec.proposer}: a draft of another vocabulary, mapped by {mapping}; its acceptance "
                         "is its row's")
        return runner
    except NotImplementedError as e:
        notes.append(f"{spec.proposer} skipped: {e}")
    except SpeculantError as e:
        notes.append(f"{spec.proposer} skipped: {e}")
    return None


def make_jobs(prompts: list[BenchPrompt], batch: int, temperature: float, max_tokens: int, reps: int,
              seed: int) -> list[Job]:
    """Batches of `batch` prompts, cycling through the set so every size decodes at least every prompt
    once; sampled requests get a fixed seed each, the same for every configuration."""
    n_jobs = max(1, -(-len(prompts) // batch))
    jobs = []
    for rep in range(reps):
        for j in range(n_jobs):
            chosen = [prompts[(j * batch + i) % len(prompts)] for i in range(batch)]
            classes = {p.prompt_class for p in chosen}
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                     seed=seed + 1000 * rep + j * batch + i if temperature > 0 else None)
                      for i in range(batch)]
            jobs.append(Job([p.id for p in chosen], classes.pop() if len(classes) == 1 else ALL,
                            [p.token_ids for p in chosen], params, rep))
    return jobs


class Progress:
    """One progress bar per phase, on stderr; silent when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def phase(self, desc: str, total: int) -> Callable[[str], None]:
        bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=not self.enabled, leave=True,
                   dynamic_ncols=True)

        def tick(label: str = "") -> None:
            if label:
                bar.set_postfix_str(label, refresh=False)
            bar.update()
            if bar.n >= bar.total:
                bar.close()

        return tick


def run_bench(plan: BenchPlan) -> BenchResult:
    started = time.time()
    if plan.threads:
        torch.set_num_threads(plan.threads)
    meta = machine_facts()
    progress = Progress(plan.progress)
    model_path = resolve_model_path(plan.model)
    target = load_model(model_path, dtype=plan.dtype, device=plan.device, quantization=plan.quantization)
    prompts = load_prompts(plan.prompts, target.tokenizer, target.config.vocab_size, plan.chat,
                           plan.per_class, plan.max_prompt_tokens)
    if not prompts:
        raise SpeculantError("no prompts to run")
    max_len = max(len(p.token_ids) for p in prompts) + plan.max_tokens + 1
    meta.update(model=str(model_path), params=target.load_info["params"], weight_bytes=weight_bytes(target.model),
                dtype=str(target.model.dtype).removeprefix("torch."), device=plan.device,
                quantization=target.quantization or "none", prompts=len(prompts),
                prompt_classes=list(dict.fromkeys(p.prompt_class for p in prompts)), command=plan.command)

    cost_sizes = plan.cost_batch_sizes or plan.batch_sizes
    tick = progress.phase("cost curve C(T)", len(cost_sizes) * (plan.cost_reps + 1) * plan.max_width)
    curve = measure_cost_curve(target.model, cost_sizes, plan.max_width, min(256, max_len),
                               plan.cost_reps, lambda: tick())

    notes: list[str] = []
    experiments = {"k": k_sweep(plan, target, model_path, prompts, max_len, notes, progress)}
    experiments["k"].rows = summarize(experiments["k"].measurements, experiments["k"].runners, curve)
    best = best_k_per_method(experiments["k"].rows) if plan.batch_k is None else {}
    experiments["batch"] = batch_sweep(plan, target, prompts, max_len, best, experiments["k"], progress)
    hot = [t for t in plan.temperatures if t > 0]
    if hot:
        experiments["temperature"] = temperature_sweep(plan, target, prompts, max_len, best, hot, progress)
    for e in list(experiments.values())[1:]:
        e.rows = summarize(e.measurements, e.runners, curve)
    meta.update(duration_s=time.time() - started, load_average_end=_load_average(),
                started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)))
    return BenchResult(plan, meta, curve, experiments, list(dict.fromkeys(notes)))


def k_sweep(plan: BenchPlan, target: LoadedModel, model_path: Path, prompts: list[BenchPrompt], max_len: int,
            notes: list[str], progress: Progress) -> Experiment:
    runners: list[Runner] = [engine_runner(target, None, 1, max_len)]
    for k in plan.ks:
        configs, skipped = proposer_configs(plan, k)
        notes += skipped
        runners += [r for spec in configs if (r := try_runner(target, spec, 1, max_len, notes))]
    runners += [r for spec in adaptive_configs(plan) if (r := try_runner(target, spec, 1, max_len, notes))]
    runners += peer_runners(plan, target, model_path, max_len, notes)
    jobs = make_jobs(prompts, 1, 0.0, plan.max_tokens, plan.reps, plan.seed)
    try:
        warm_up(runners, jobs[0], notes)
        measurements = run_jobs(runners, jobs, progress.phase("k sweep (batch 1)", len(jobs) * len(runners)),
                                plan.repeat, notes)
        notes += [r.summary() for r in runners if hasattr(r, "summary")]
    finally:  # peers that are processes of their own (llama-server) stop here
        for r in runners:
            if hasattr(r, "close"):
                r.close()
    return Experiment("k", "batch 1, greedy: plain decoding vs every proposer at every k, and the peers",
                      [r.descriptor() for r in runners], measurements)


def peer_runners(plan: BenchPlan, target: LoadedModel, model_path: Path, max_len: int,
                 notes: list[str]) -> list[Runner]:
    runners: list[Runner] = []
    eos = list(target.eos_token_ids)
    if "transformers" in plan.peers:
        found, skipped = transformers_peers(model_path, draft_paths(plan)["draft_model"], [plan.peer_k], eos,
                                            target.model.dtype, target.model.device)
        runners += found
        notes += skipped
    if "llama.cpp" in plan.peers:
        found, skipped = llama_cpp_peers(model_path, [plan.peer_k], eos, max_len + plan.peer_k + 8)
        runners += found
        notes += skipped
    if "llama-server" in plan.peers:
        found, skipped = llama_server_peers(model_path, max_len + 8, plan.threads,
                                            draft_path=draft_paths(plan)["draft_model"])
        runners += found
        notes += skipped
    return runners


def best_k_per_method(rows: list[Row]) -> dict[str, int]:
    """Each proposer's k with the best measured speed-up over all prompts of the k sweep."""
    best: dict[str, tuple[float, int]] = {}
    for r in rows:
        if r.family == "speculant" and r.method and r.prompt_class == ALL and r.speedup:
            if r.speedup > best.get(r.method, (0.0, 0))[0]:
                best[r.method] = (r.speedup, r.k)
    return {m: k for m, (_, k) in best.items()}


def chosen_configs(plan: BenchPlan, best: dict[str, int]) -> list[SpeculativeConfig]:
    """Each proposer at the plan's batch_k, else at its best k from the k sweep; then adaptive."""
    configs = []
    for method in plan.proposers:
        k = plan.batch_k or best.get(method)
        if k:
            configs += [c for c in proposer_configs(plan, k)[0] if c.proposer == method]
    return configs + adaptive_configs(plan)


def batch_sweep(plan: BenchPlan, target: LoadedModel, prompts: list[BenchPrompt], max_len: int,
                best: dict[str, int], k_exp: Experiment, progress: Progress) -> Experiment:
    """Batch 1 comes from the k sweep (same prompts, same settings); every larger size gets its own
    engines, built, run interleaved and freed before the next size."""
    configs = chosen_configs(plan, best)
    names = {"speculant k=0"} | {config_name(spec_method(c), c.num_speculative_tokens) for c in configs}
    exp = Experiment("batch", "greedy: plain vs each proposer at its best k, every batch size",
                     [r for r in k_exp.runners if r.name in names])
    reuse = 1 in plan.batch_sizes and names <= {r.name for r in exp.runners}
    if reuse:
        exp.measurements = [m for m in k_exp.measurements if m.runner in names]
    sizes = [b for b in plan.batch_sizes if b > 1 or not reuse]
    plan_jobs = {b: make_jobs(prompts, b, 0.0, plan.max_tokens, plan.reps, plan.seed) for b in sizes}
    tick = progress.phase("batch sweep", sum(len(j) for j in plan_jobs.values()) * len(names))
    for b in sizes:
        runners = [engine_runner(target, spec, b, max_len) for spec in [None, *configs]]
        warm_up(runners, plan_jobs[b][0])
        exp.measurements += run_jobs(runners, plan_jobs[b], tick, plan.repeat)
        exp.runners = [r.descriptor() for r in runners]
    return exp


def temperature_sweep(plan: BenchPlan, target: LoadedModel, prompts: list[BenchPrompt], max_len: int,
                      best: dict[str, int], temperatures: list[float], progress: Progress) -> Experiment:
    configs = chosen_configs(plan, best)
    runners: list[Runner] = [engine_runner(target, spec, 1, max_len) for spec in [None, *configs]]
    jobs = [j for t in temperatures for j in make_jobs(prompts, 1, t, plan.max_tokens, plan.reps, plan.seed)]
    warm_up(runners, jobs[0])
    measurements = run_jobs(runners, jobs, progress.phase("temperature sweep", len(jobs) * len(runners)),
                            plan.repeat)
    return Experiment("temperature", "batch 1, sampled: plain vs each proposer at its best k",
                      [r.descriptor() for r in runners], measurements)


def cost_table(result: BenchResult) -> list[dict]:
    """Cost per million generated tokens at each batch size, plain and speculating, at the plan's price: from
    whole requests' rates (prefill included), or decode rates in a report written before those were kept."""
    price = result.plan.price_per_hour
    if not price or "batch" not in result.experiments:
        return []
    table = []
    for row in result.experiments["batch"].rows:
        rate, basis = (row.e2e_tokens_per_s, "end to end") if row.e2e_tokens_per_s else (row.tokens_per_s, "decode")
        if row.prompt_class == ALL and rate:
            table.append({"runner": row.runner, "batch_size": row.batch_size, "tokens_per_s": rate,
                          "rate": basis, "usd_per_million_tokens": usd_per_million(rate, price)})
    return table
