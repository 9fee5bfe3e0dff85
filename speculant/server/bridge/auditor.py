"""The lossless audit in a running server (`speculant serve --audit RATE`), on the engine thread.

A sampled share of the requests that ran with speculation is decoded again without it (k = 0: the same target,
prompt, sampling parameters and seed) in rows live traffic leaves: the re-decode is a background sequence
(scheduler.py), admitted only with a row to spare and no live request waiting, paused while a live prompt is
fed, given up when live requests need its row. Its tokens are compared with what the request was sent;
/metrics counts each result, and a mismatch is logged with the request id, proposer, path and position.

Its prompt starts from the prefix cache like any other (the speculative run left the prompt's keys there): a
prompt's keys are the same bits whatever computed them (docs/design.md §1), so the audit checks the decoding,
where speculation acts; `speculant audit` replays a record on a fresh engine, cache included.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, field

from speculant.audit.rules import describe_path, first_difference, lossy_settings, plain_params, sampled, skip_reason
from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.output import StepOutput
from speculant.sequence import Sequence
from speculant.server.http.metrics import ServerMetrics

log = logging.getLogger("speculant.audit")

MAX_BACKLOG = 256  # re-decodes waiting for a spare row; more are skipped ("backlog")


def audit_rate(text: str) -> float:
    """--audit's value: a share of requests, 0 to 1."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not 0 <= rate <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"the share of requests audited is a number from 0 to 1 (0.01: one in a "
                                         f"hundred; 0: off), got {text!r}")
    return rate


@dataclass
class AuditSettings:
    rate: float = 0.0  # the share of auditable requests decoded again; 0: off
    record: str | None = None  # --record: the file each completed request is appended to
    # The speculative configuration served, as the record names it; lossy settings in it exclude every request.
    speculative_config: dict | None = None
    lossy: list[str] = field(default_factory=list)  # lossy settings in force server-wide
    max_backlog: int = MAX_BACKLOG


def audit_settings_from_args(args: argparse.Namespace) -> AuditSettings:
    """--audit, --record and the speculative configuration they report (a bad --record file fails here, before
    the model loads)."""
    from speculant.arguments import speculative_config_from_args

    rate = getattr(args, "audit", 0.0) or 0.0
    record = getattr(args, "record", None)
    if record is not None:
        try:
            with open(record, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise SpeculantError(f"--record cannot append to {record}: {e.strerror or e}") from None
    spec = speculative_config_from_args(args)
    spec_dict = asdict(spec) if spec is not None else None
    lossy = lossy_settings(vars(args)) + lossy_settings(spec_dict or {}, "speculative_config.")
    return AuditSettings(rate, record, spec_dict, lossy)


@dataclass
class Job:
    """A finished live sequence waiting for its re-decode, then the re-decode itself."""

    request_id: str  # the live sequence's id
    prompt_ids: list[int]
    params: SamplingParams  # the re-decode's
    expected: list[int]  # the tokens the request was sent
    seq: Sequence | None = None
    tries: int = 0  # re-decodes started, given up for live requests but the last


# A re-decode given up for live requests goes back to the queue's front this many times before it counts as
# skipped: a burst of traffic delays the audit rather than thinning it.
MAX_TRIES = 3


class Auditor:
    def __init__(self, engine: Engine, metrics: ServerMetrics, settings: AuditSettings):
        self.engine, self.metrics, self.settings = engine, metrics, settings
        self.backlog: deque[Job] = deque()
        self.running: dict[str, Job] = {}  # by the re-decode's sequence id
        self.proposer = engine.proposer_name
        self.path = describe_path(engine)
        metrics.enable_audit()
        if settings.lossy:
            log.warning("the audit skips every request: lossy settings are in force (%s)", ", ".join(settings.lossy))

    @property
    def enabled(self) -> bool:
        """Only speculation can make output differ from plain decoding: an engine without it has nothing to
        audit."""
        return self.settings.rate > 0 and self.proposer is not None

    def owns(self, seq: Sequence) -> bool:
        return seq.request_id in self.running

    def background_rows(self) -> tuple[int, int]:
        """(running, waiting) re-decodes in the engine."""
        sched = self.engine.scheduler
        return sum(s.background for s in sched.running), sum(s.background for s in sched.waiting)

    def offer(self, seq: Sequence, request_id: str) -> None:
        """A live sequence of request `request_id` finished: queue its re-decode if the request is sampled."""
        if not self.enabled or not sampled(request_id, self.settings.rate):
            return
        if seq.finish_reason not in ("stop", "length") or not seq.output_ids:
            return
        reason = skip_reason(seq.params, self.settings.lossy)
        if reason is None and len(self.backlog) >= self.settings.max_backlog:
            reason = "backlog"
        if reason is not None:
            self.metrics.observe_audit("skipped", reason)
            return
        self.backlog.append(Job(seq.request_id, list(seq.prompt_ids), plain_params(seq.params, seq.num_generated),
                                list(seq.output_ids)))

    def admit(self) -> None:
        """Hand queued re-decodes to the engine while a row is spare and no live request waits."""
        sched = self.engine.scheduler
        while self.backlog and sched.spare_rows() > 0 and not sched.foreground_waiting():
            job = self.backlog.popleft()
            try:
                job.seq = self.engine.add_request(job.prompt_ids, job.params, f"audit-{job.request_id}",
                                                  speculate=False, background=True)
            except SpeculantError as e:
                log.warning("audit of %s not started: %s", job.request_id, e)
                self.metrics.observe_audit("skipped", "failed")
                continue
            job.tries += 1
            self.running[job.seq.request_id] = job

    def observe(self, out: StepOutput) -> None:
        """A step's output for a re-decode: once it has finished, compare."""
        seq = out.seq
        if not seq.finished:
            return
        job = self.running.pop(seq.request_id)
        if seq.finish_reason == "abort":  # live requests needed its row: again once rows are spare
            if job.tries < MAX_TRIES:
                job.seq = None
                self.backlog.appendleft(job)
                return
            self.metrics.observe_audit("skipped", "preempted")
            return
        if out.error is not None or seq.finish_reason == "error":
            self.metrics.observe_audit("skipped", "failed")
            return
        diff = first_difference(job.expected, seq.output_ids)
        if diff is None:
            self.metrics.observe_audit("match")
            return
        self.metrics.observe_audit("mismatch")
        log.warning("audit mismatch: request %s (proposer %s; %s): plain decoding differs from the speculative "
                    "output, %s", job.request_id, self.proposer, self.path, diff.describe())
