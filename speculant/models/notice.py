"""One line on stderr before a wait a user would otherwise take for a hang: a kernel build, a GGUF repack, a
cost curve's measurement. Shown at the default log level (its logger has its own handler and level);
`speculant --quiet`, or raising the `speculant.notice` logger's level, silences it."""

from __future__ import annotations

import logging
import sys
import time

# Waits shorter than this pass without a word.
THRESHOLD_S = 5.0

log = logging.getLogger("speculant.notice")


class _Stderr(logging.Handler):
    """Writes to sys.stderr as it is at each line (not at import), so that a redirected stderr gets it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


if not log.handlers:
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("speculant: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the root logger's format (time, level) is for diagnostics, not for this line


def set_quiet(quiet: bool) -> None:
    log.setLevel(logging.WARNING if quiet else logging.INFO)


def duration(seconds: float) -> str:
    """A rough duration: "20 s", "3 min"."""
    if seconds < 90:
        return f"{max(5, round(seconds / 5) * 5):.0f} s"
    return f"{round(seconds / 60):.0f} min"


def announce(what: str, seconds: float) -> None:
    """Say that `what` starts and takes about `seconds`, where that is long enough to be noticed."""
    if seconds >= THRESHOLD_S:
        log.info("%s: about %s, once", what, duration(seconds))


def enabled() -> bool:
    """Whether these lines show (progress bars of first-run waits follow it too)."""
    return log.isEnabledFor(logging.INFO)


class Countdown:
    """The tick of a measurement made of `rounds` like rounds of `per_round` ticks each: after the first round,
    announces what the others will take, where that is long."""

    def __init__(self, what: str, rounds: int, per_round: int):
        self.what, self.rounds, self.per_round = what, rounds, per_round
        self.ticks = 0
        self.start = time.perf_counter()

    def __call__(self) -> None:
        self.ticks += 1
        if self.ticks == self.per_round:
            announce(self.what, (time.perf_counter() - self.start) * (self.rounds - 1))
