"""The engine thread: continuous batching behind the asyncio front end.

The engine is not thread-safe, so one thread owns it. HTTP handlers hand requests over through a
command queue; between two steps the thread admits new requests (they join the running batch at the
next step), aborts those whose client left (their slot is free for the next step), then runs one
batched step and sends every sequence's new tokens to the asyncio queue of the request it belongs
to. With nothing to do it sleeps on an Event instead of spinning.

Requests are isolated from each other: a sequence whose serving raises fails its own request (the engine
retries the rest of the batch without it), waiting sequences are admitted round-robin across requests
(one request's many sequences cannot hold every free slot), and an optional time limit ends a request
that runs too long.

With the audit on (auditor.py), a finished request's sequences may be decoded again in rows live traffic leaves;
with a record file (recorder.py), each request that completes is appended to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from speculant.audit.log import record
from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.scheduler import RoundRobin
from speculant.sequence import Sequence, TokenLogprob
from speculant.server.bridge.auditor import Auditor
from speculant.server.bridge.recorder import Recorder
from speculant.server.http.metrics import ServerMetrics

log = logging.getLogger("speculant.server")

# The share of the engine thread's time that steps serving only background work (the audit's re-decodes) may take.
BACKGROUND_DUTY = 0.5


class ShuttingDown(Exception):
    """The server is stopping: the request was refused or cut short."""


class EngineFailure(Exception):
    """The engine raised an unexpected error while serving this request (the details are in the log)."""


class RequestTimedOut(Exception):
    """The request ran past the server's per-request time limit."""


class Overloaded(Exception):
    """Every batch row is taken and the waiting queue is full: the client should retry later."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Delta:
    """What one step gave one sequence, copied in the engine thread (the Sequence keeps changing)."""

    index: int  # the choice this sequence fills
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a sequence's first Delta, if asked


@dataclass
class Admitted:
    seqs: list[Sequence]


class RequestStream:
    """One HTTP request's sequences (prompts × n), seen from the event loop.

    Iterate it for Deltas until every sequence has finished; close it when done, which aborts
    whatever is still generating (a client that left frees its batch slots at once)."""

    def __init__(self, worker: EngineWorker, request_id: str,
                 prompts: list[tuple[list[int], SamplingParams]], origin: tuple[str, object] | None = None):
        self.worker = worker
        self.request_id = request_id
        self.prompts = prompts
        self.origin = origin  # (endpoint, body as received), kept for the record file
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.seqs: list[Sequence] = []
        self.unfinished = len(prompts)
        self.closed = False

    def put(self, item: Delta | Admitted | Exception) -> None:
        """Called from the engine thread."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def admitted(self) -> list[Sequence]:
        """Wait until the engine took the request; raises SpeculantError if it refused it."""
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        self.seqs = item.seqs
        return self.seqs

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            self.unfinished -= item.finish_reason is not None
            yield item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.worker.in_flight.discard(self)
        if self.unfinished:
            self.worker.abort(self)


@dataclass
class _Entry:
    stream: RequestStream
    index: int
    last_emit: float | None = None


class EngineWorker:
    def __init__(self, engine: Engine, metrics: ServerMetrics, request_timeout_s: float | None = None,
                 max_waiting: int | None = None, auditor: Auditor | None = None, recorder: Recorder | None = None,
                 described: dict | None = None):
        self.engine = engine
        self.metrics = metrics
        self.auditor = auditor
        self.recorder = recorder
        self.described = described or {}  # the engine as records name it
        self.request_timeout_s = request_timeout_s  # None: no limit
        self.max_waiting = max_waiting  # requests beyond the batch's rows; None: no bound
        self.mean_request_s = 10.0  # a running mean of requests' durations, for Retry-After
        self.in_flight: set[RequestStream] = set()  # event-loop side only
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._entries: dict[str, _Entry] = {}  # engine-thread side only: sequence id → its request
        self._requests: dict[RequestStream, list[Sequence]] = {}  # engine-thread side: each request's sequences
        self._thread = threading.Thread(target=self._run, name="speculant-engine", daemon=True)
        engine.scheduler.policy = RoundRobin(self._owner)

    # -- event-loop side --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the engine thread has died: nothing would ever answer this server's requests."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._send("stop", None)
        self._thread.join(timeout_s)

    def submit(self, request_id: str, prompts: list[tuple[list[int], SamplingParams]],
               origin: tuple[str, object] | None = None) -> RequestStream:
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        waiting = len(self.in_flight) - self.engine.max_batch_size
        if self.max_waiting is not None and waiting >= self.max_waiting:
            # Each batch row frees in about a request's time; the queue ahead needs that many turns.
            turns = 1 + waiting // self.engine.max_batch_size
            raise Overloaded(f"the server is busy: {len(self.in_flight)} requests in flight, {waiting} of them "
                             f"waiting (the queue holds {self.max_waiting}); retry later",
                             max(1, math.ceil(turns * self.mean_request_s)))
        stream = RequestStream(self, request_id, prompts, origin)
        self.in_flight.add(stream)
        self._send("add", stream)
        return stream

    def abort(self, stream: RequestStream) -> None:
        self._send("abort", stream)

    async def drain(self, timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Refuse new requests, give in-flight ones `timeout_s` to finish, then end the rest with a
        clean error rather than a dropped connection."""
        self.accepting = False
        deadline = time.perf_counter() + timeout_s
        if self.in_flight:
            log.info("waiting up to %.0fs for %d in-flight request(s)", timeout_s, len(self.in_flight))
        while self.in_flight and time.perf_counter() < deadline and not give_up():
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("aborting %d request(s) still in flight at shutdown", len(self.in_flight))
            self._send("abort_all", None)
            while self.in_flight and not give_up() and time.perf_counter() < deadline + 5:
                await asyncio.sleep(0.05)

    def _send(self, command: str, stream: RequestStream | None) -> None:
        self._commands.put((command, stream))
        self._wake.set()

    # -- engine-thread side -----------------------------------------------------------------

    def _run(self) -> None:
        running = True
        while running:
            if not self.engine.has_unfinished() and not (self.auditor is not None and self.auditor.backlog):
                self._wake.wait()
            # Cleared before draining: a command sent after this point sets it again.
            self._wake.clear()
            running = self._apply_commands()
            if running and self.request_timeout_s is not None:
                self._end_overdue()
            if running and self.auditor is not None:
                self.auditor.admit()
            if running and self.engine.has_unfinished():
                t0 = time.perf_counter()
                self._step()
                self.observe_load()
                if not self._entries and self.engine.has_unfinished():
                    # Only the audit's re-decodes run: leave the cores to the HTTP side (a request's template and
                    # tokens) for a while; a command ends the wait at once.
                    self._wake.wait((time.perf_counter() - t0) * (1 - BACKGROUND_DUTY) / BACKGROUND_DUTY)
            self.observe_load()
        for stream in self._live_streams():
            self._abort(stream, ShuttingDown("the server shut down before the request finished"))
        if self.recorder is not None:
            self.recorder.close()

    def observe_load(self) -> None:
        """Live sequences running and waiting: the audit's rows are not load."""
        sched = self.engine.scheduler
        audit_running, audit_waiting = self.auditor.background_rows() if self.auditor else (0, 0)
        self.metrics.observe_load(len(sched.running) - audit_running, len(sched.waiting) - audit_waiting)

    def _live_streams(self) -> set[RequestStream]:
        return {entry.stream for entry in self._entries.values()}

    def _apply_commands(self) -> bool:
        """Apply the queued commands; False once told to stop."""
        while True:
            try:
                command, stream = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command == "stop":
                while not self._commands.empty():  # requests that raced the shutdown
                    late_command, late = self._commands.get_nowait()
                    if late_command == "add":
                        late.put(ShuttingDown("the server is shutting down"))
                return False
            if command == "add":
                self._add(stream)
            elif command == "abort":
                self._abort(stream, None)
            elif command == "abort_all":
                for s in self._live_streams():
                    self._abort(s, ShuttingDown("the server is shutting down"))

    def _end_overdue(self) -> None:
        now = time.perf_counter()
        for stream in self._live_streams():
            if now - stream.arrival > self.request_timeout_s:
                self._abort(stream, RequestTimedOut(f"the request ran past this server's time limit of "
                                                    f"{self.request_timeout_s:g} s"))

    def _owner(self, seq: Sequence) -> int:
        """The request a sequence belongs to: free rows go round-robin across requests."""
        entry = self._entries.get(seq.request_id)
        return id(entry.stream) if entry else id(seq)

    def _add(self, stream: RequestStream) -> None:
        try:
            ids = [f"{stream.request_id}-{i}" for i in range(len(stream.prompts))]
            seqs = self.engine.add_requests(stream.prompts, ids)
        except Exception as e:
            if not isinstance(e, SpeculantError):  # a bug: keep the thread alive for everyone else
                log.exception("engine refused request %s", stream.request_id)
                e = EngineFailure("the engine failed to admit the request")
            stream.put(e)
            return
        for i, seq in enumerate(seqs):
            self._entries[seq.request_id] = _Entry(stream, i)
            self.metrics.observe_admitted(len(seq.prompt_ids))
        self._requests[stream] = seqs
        stream.put(Admitted(seqs))

    def _abort(self, stream: RequestStream, error: Exception | None) -> None:
        self._requests.pop(stream, None)
        for seq_id in [k for k, e in self._entries.items() if e.stream is stream]:
            del self._entries[seq_id]
            self.engine.abort(seq_id)
            self.metrics.observe_finished("abort", None)
        if error is not None:
            stream.put(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A bug or an out-of-memory must not take the server down: fail the requests in the
            # batch, keep serving the next ones.
            log.exception("engine step failed outside any one sequence: %s", e)
            for stream in self._live_streams():
                self._abort(stream, EngineFailure("the engine failed while this request was in the batch"))
            return
        self.metrics.batch_size.observe(len(outputs))  # one output per sequence in the batch
        self.metrics.observe_spec(self.engine.stats)
        self.metrics.observe_prefix_cache(self.engine.prefix_cache)
        now = time.perf_counter()
        for out in outputs:
            seq = out.seq
            if self.auditor is not None and self.auditor.owns(seq):
                self.auditor.observe(out)
                continue
            entry = self._entries.get(seq.request_id)
            if entry is None:  # its request already failed this step (another of its sequences)
                continue
            if out.error is not None:
                self._abort(entry.stream, EngineFailure("the engine failed while serving this request"))
                continue
            entry.stream.put(Delta(entry.index, list(out.new_token_ids), out.new_text, seq.finish_reason,
                                   out.new_logprobs, seq.prompt_logprobs if entry.last_emit is None else None))
            if entry.last_emit is None:
                self.metrics.observe_first_tokens(len(out.new_token_ids), now - entry.stream.arrival)
            else:
                self.metrics.observe_tokens(len(out.new_token_ids), now - entry.last_emit)
            entry.last_emit = now
            if seq.finished:
                del self._entries[seq.request_id]
                self.metrics.observe_finished(seq.finish_reason, now - entry.stream.arrival)
                self.mean_request_s += 0.1 * (now - entry.stream.arrival - self.mean_request_s)
                self._finished(seq, entry.stream)

    def _finished(self, seq: Sequence, stream: RequestStream) -> None:
        """A live sequence is done: offer it to the audit; once its whole request is, record the request."""
        if self.auditor is not None:
            self.auditor.offer(seq, stream.request_id)
        seqs = self._requests.get(stream)
        if seqs is None or not all(s.finished for s in seqs):
            return
        del self._requests[stream]
        if self.recorder is not None:
            endpoint, body = stream.origin or (None, None)
            self.recorder.write(record(stream.request_id, endpoint, body, seqs, self.described))
