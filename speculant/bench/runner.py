"""Timed runs, side by side: every configuration on the same prompts, interleaved.

A run is one batch of prompts decoded to the end. Its first step (prefill, plus a first verify
when speculating) is timed apart as the time to first token; tokens/s counts the tokens after
that step over the time after it, so prompt length does not dilute the decode speed-up.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from speculant.config import ADAPTIVE_BATCHED, SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.llm import engine_for
from speculant.models.loader import LoadedModel
from speculant.sequence import SpecStats


@dataclass
class Measurement:
    runner: str
    prompt_ids: list[str]
    prompt_class: str
    batch_size: int
    temperature: float
    rep: int
    output_ids: list[list[int]]
    ttft_s: float  # the first step: prefill of the whole batch
    decode_s: float  # after the first step, until the last sequence finished
    decode_tokens: int  # tokens emitted after the first step, all sequences together
    draft_s: float | None = None
    target_s: float | None = None
    other_s: float | None = None
    steps: int | None = None  # engine steps (target passes over the batch)
    stats: dict | None = None  # SpecStats of the run's sequences, summed
    passes: dict | None = None  # the steps' target passes by width → [passes, seconds] (EngineTiming.passes)

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.output_ids))

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None

    def as_dict(self) -> dict:
        """Everything but the output ids, which a short hash per sequence stands for (identity checks
        stay possible without megabytes of token ids)."""
        d = {k: v for k, v in self.__dict__.items() if k != "output_ids"}
        hashes = [hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12] for ids in self.output_ids]
        return {**d, "output_lengths": list(map(len, self.output_ids)), "output_hashes": hashes,
                "tokens_per_s": self.tokens_per_s}


@dataclass
class Runner:
    """Something that decodes a batch of token-id prompts and is timed: a Speculant engine
    configuration or a peer. `reference` names the plain runner of the same family, the one
    its speed-up and output identity are measured against."""

    name: str
    family: str  # "speculant", "transformers", "llama.cpp"
    method: str | None  # None: plain decoding
    k: int
    reference: str
    max_batch_size: int = 1
    extra_nodes: int = 0  # drafts a step verifies beyond k (a draft tree's other candidates)

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> Measurement:
        raise NotImplementedError

    def forget(self) -> None:
        """Drop what the runner learned from earlier requests: no run drafts from another's answers."""

    def descriptor(self) -> Runner:
        """The runner's identity without its model or engine, to keep after the runs."""
        return Runner(self.name, self.family, self.method, self.k, self.reference, self.max_batch_size,
                      self.extra_nodes)

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "method": self.method, "k": self.k,
                "reference": self.reference, "extra_nodes": self.extra_nodes}


def config_name(method: str | None, k: int) -> str:
    return "speculant k=0" if method is None else f"speculant {method} k={k}"


def spec_method(spec: SpeculativeConfig) -> str:
    """The method as the report names it: an adaptive configuration is its own entry."""
    if not spec.adaptive:
        return spec.proposer
    return f"{spec.proposer} adaptive" + (" from batch 2" if spec.adaptive == ADAPTIVE_BATCHED else "")


@dataclass
class EngineRunner(Runner):
    engine: Engine | None = None

    def forget(self) -> None:
        if self.engine.proposer is not None:
            self.engine.proposer.forget()

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> Measurement:
        engine = self.engine
        before = engine.timing.as_dict()
        seqs = engine.add_requests(zip(prompts, params))
        t0 = time.perf_counter()
        first = engine.step()  # every sequence is admitted at once: max_batch_size >= len(prompts)
        t1 = time.perf_counter()
        while any(not s.finished for s in seqs):
            engine.step()
        t2 = time.perf_counter()
        after = engine.timing.as_dict()
        stats = SpecStats()
        for s in seqs:
            add_stats(stats, s.stats)
        return Measurement(
            runner=self.name, prompt_ids=[], prompt_class="", batch_size=len(prompts),
            temperature=params[0].temperature, rep=0, output_ids=[s.output_ids for s in seqs],
            ttft_s=t1 - t0, decode_s=t2 - t1,
            decode_tokens=sum(s.num_generated for s in seqs) - sum(len(o.new_token_ids) for o in first),
            draft_s=after["draft_s"] - before["draft_s"], target_s=after["target_s"] - before["target_s"],
            other_s=after["other_s"] - before["other_s"], steps=after["steps"] - before["steps"],
            stats=stats_as_dict(stats), passes=passes_between(before["passes"], after["passes"]))


def passes_between(before: dict, after: dict) -> dict:
    """EngineTiming.passes gained between two readings: width → [passes, seconds]."""
    gained = {}
    for width, (n, s) in after.items():
        n0, s0 = before.get(width, (0, 0.0))
        if n > n0:
            gained[width] = [n - n0, s - s0]
    return gained


def stats_as_dict(s: SpecStats) -> dict:
    """SpecStats.as_dict() plus the per-position counts, so runs can be summed later."""
    return {**s.as_dict(), "drafts_per_pos": list(s.drafts_per_pos),
            "accepted_per_pos": list(s.accepted_per_pos)}


def stats_from_dict(d: dict) -> SpecStats:
    return SpecStats(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"],
                     list(d["accepted_per_pos"]), list(d["drafts_per_pos"]), d["target_passes"])


def add_stats(total: SpecStats, s: SpecStats) -> None:
    total.num_drafts += s.num_drafts
    total.num_draft_tokens += s.num_draft_tokens
    total.num_accepted_tokens += s.num_accepted_tokens
    total.target_passes += s.target_passes
    grow = len(s.drafts_per_pos) - len(total.drafts_per_pos)
    if grow > 0:
        total.drafts_per_pos += [0] * grow
        total.accepted_per_pos += [0] * grow
    for i, (d, a) in enumerate(zip(s.drafts_per_pos, s.accepted_per_pos)):
        total.drafts_per_pos[i] += d
        total.accepted_per_pos[i] += a


def engine_runner(target: LoadedModel, spec: SpeculativeConfig | None, max_batch_size: int,
                  max_model_len: int) -> EngineRunner:
    """An engine over an already-loaded target: configurations share the weights, each has its
    own KV cache and proposer state."""
    engine = engine_for(target, spec, max_batch_size, max_model_len)
    method = spec_method(spec) if spec else None
    return EngineRunner(config_name(method, engine.k), "speculant", method, engine.k, config_name(None, 0),
                        max_batch_size, engine.proposer.extra_nodes if engine.proposer else 0, engine=engine)


@dataclass
class Job:
    """One batch of prompts to decode, the same for every runner."""

    prompt_ids: list[str]
    prompt_class: str
    tokens: list[list[int]]
    params: list[SamplingParams]
    rep: int = 0


def interleave(runners: list[Runner], jobs: list[Job]) -> Iterator[tuple[Runner, Job]]:
    """A B C, B C A, C A B, …: every job runs on every runner back to back, so drift hits all alike,
    and the order rotates so no runner always goes first (cold caches) or last."""
    for i, job in enumerate(jobs):
        shift = i % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            yield runner, job


def run_jobs(runners: list[Runner], jobs: list[Job], tick: Callable[[str], None] | None = None,
             repeat: bool = False, notes: list[str] | None = None) -> list[Measurement]:
    """Each job on each runner, timed. A runner forgets earlier requests before each job (an answer history
    would otherwise draft a repetition from the same prompt's earlier answer); with `repeat`, it then
    decodes the job once untimed: the case of requests that repeat. A peer that fails is left out of the
    report (removed from `runners`) with one line in `notes`; our own configurations' errors propagate."""
    out = []
    for runner, job in interleave(list(runners), jobs):
        if runner not in runners:
            continue
        if tick:
            tick(runner.name)
        runner.forget()
        try:
            if repeat:
                runner.run(job.tokens, job.params)
            m = runner.run(job.tokens, job.params)
        except Exception as e:
            drop_failed_peer(runners, runner, e, notes)
            out = [m for m in out if m.runner != runner.name]
            continue
        m.prompt_ids, m.prompt_class, m.rep = job.prompt_ids, job.prompt_class, job.rep
        out.append(m)
    return out


def warm_up(runners: list[Runner], job: Job, notes: list[str] | None = None) -> None:
    """One short untimed run each: first calls pay for kernel selection and page faults."""
    short = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=min(8, p.max_tokens or 8))
             for p in job.params]
    for runner in list(runners):
        try:
            runner.run(job.tokens, short)
        except Exception as e:
            drop_failed_peer(runners, runner, e, notes)


def drop_failed_peer(runners: list[Runner], runner: Runner, error: Exception, notes: list[str] | None) -> None:
    """A peer's own bug (another library's) must not end the whole benchmark: it is reported and left out."""
    if runner.family == "speculant" or notes is None:
        raise error
    runners.remove(runner)
    notes.append(f"{runner.name} left out: it failed ({type(error).__name__}: {str(error).splitlines()[0][:160]})")
