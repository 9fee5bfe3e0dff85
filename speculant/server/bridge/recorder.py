"""`speculant serve --record PATH`: each completed request appended to PATH as one JSON line (audit/log.py).

Lines are written by a thread of their own: the engine thread hands a record over and goes on. Each line is
one append (O_APPEND, one write), so replicas sharing the file never interleave within a line."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading

log = logging.getLogger("speculant.server")


class Recorder:
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._write_forever, name="speculant-record", daemon=True)
        self.thread.start()

    def write(self, record: dict) -> None:
        self.queue.put(record)

    def close(self) -> None:
        """Write what is queued, then stop."""
        self.queue.put(None)
        self.thread.join(10)
        os.close(self.fd)

    def _write_forever(self) -> None:
        while (record := self.queue.get()) is not None:
            try:
                os.write(self.fd, (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode())
            except OSError as e:  # a full disk loses records, never requests
                log.error("cannot append to the record file %s: %s", self.path, e)
