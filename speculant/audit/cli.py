"""`speculant audit LOG`: the recorded requests (`speculant serve --record LOG`) decoded again without
speculation on a model, each compared with what the server sent; optionally decoded with speculation again too.

Prints the counts (match, mismatch, skipped and why) and each mismatch with its request id and first differing
position; exits 3 on any mismatch (1 on an error), 0 when every compared sequence matched."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from speculant.audit.log import Recorded, read_log
from speculant.audit.rules import Difference, describe_path, first_difference, lossy_settings, plain_params, skip_reason
from speculant.errors import SpeculantError
from speculant.sequence import Sequence

MISMATCH_EXIT = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    from speculant.arguments import add_model_arguments

    p.add_argument("log", metavar="LOG", help="a record file written by `speculant serve --record LOG`")
    add_model_arguments(p)
    p.add_argument("--respec", action="store_true",
                   help="also decode each request with speculation again (the speculation flags given, or the "
                        "model's default) and compare that with plain decoding")


@dataclass
class Check:
    """One recorded sequence's replay: the plain re-decode, and with --respec the speculative one."""

    label: str  # request id and choice
    expected: list[int]
    plain: Sequence
    spec: Sequence | None = None


def run(args: argparse.Namespace) -> int:
    from speculant.arguments import engine_from_args

    records = read_log(args.log)  # a bad line fails before the model loads
    engine = engine_from_args(args)
    if args.respec and not engine.k:
        raise SpeculantError("--respec decodes with speculation again: this run does not speculate (drop "
                             "--no-speculation, or give --ngram, --draft-model ...)")
    skipped: Counter[str] = Counter()
    checks = queue_checks(engine, records, args.respec, skipped)
    engine.generate([s for c in checks for s in (c.plain, c.spec) if s is not None])
    print(f"audit of {args.log}: {len(records)} request(s) on {Path(engine.target.source).name} "
          f"({describe_path(engine)}{', speculation ' + engine.proposer.name if args.respec else ''})")
    mismatches = report(checks, skipped)
    return MISMATCH_EXIT if mismatches else 0


def queue_checks(engine, records: list[Recorded], respec: bool, skipped: Counter) -> list[Check]:
    """Every auditable recorded sequence added to the engine (plain, and with --respec speculative too)."""
    checks = []
    for rec in records:
        served = Path(str(rec.engine.get("source", ""))).name
        if served and served != Path(engine.target.source).name:
            print(f"note: line {rec.line} ({rec.request_id}) was served by {served}", file=sys.stderr)
        lossy = lossy_settings(rec.engine) + lossy_settings(rec.body if isinstance(rec.body, dict) else {}, "body.")
        for s in rec.sequences:
            label = f"{rec.request_id} choice {s.index}"
            reason = skip_reason(s.params, lossy) if s.output_ids else "empty"
            if reason is None:
                try:
                    params = plain_params(s.params, len(s.output_ids))
                    check = Check(label, s.output_ids, engine.add_request(s.prompt_ids, params, f"{label} plain",
                                                                         speculate=False))
                    if respec:
                        check.spec = engine.add_request(s.prompt_ids, params, f"{label} spec")
                    checks.append(check)
                except SpeculantError as e:  # this model cannot take the prompt
                    print(f"skipped {label} (line {rec.line}): {e}", file=sys.stderr)
                    reason = "refused"
            if reason is not None:
                skipped[reason] += 1
    return checks


def report(checks: list[Check], skipped: Counter) -> int:
    """Print each mismatch and the counts → the number of mismatches."""
    results = Counter()
    for c in checks:
        found: list[tuple[str, Difference]] = []
        diff = first_difference(c.expected, c.plain.output_ids)
        if diff is not None:
            found.append(("the recorded output", diff))
        if c.spec is not None:
            again = first_difference(c.spec.output_ids, c.plain.output_ids)
            if again is not None:
                found.append(("speculative decoding again", again))
        results["mismatch" if found else "match"] += 1
        for what, d in found:
            print(f"MISMATCH {c.label}: plain decoding differs from {what}, {d.describe()}")
    results["skipped"] = sum(skipped.values())
    why = f" ({', '.join(f'{n} {r}' for r, n in sorted(skipped.items()))})" if skipped else ""
    print(f"match {results['match']}, mismatch {results['mismatch']}, skipped {results['skipped']}{why}")
    return results["mismatch"]
