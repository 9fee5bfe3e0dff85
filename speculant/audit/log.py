"""The record of served requests (`speculant serve --record PATH`), one JSON object a line, and its reader.

A line holds what a replay needs without the server: each sequence's prompt token ids (after the chat
template, tools, a previous response's conversation) and sampling parameters, and the tokens it returned;
beside them the endpoint and the body as received, the request id, and the engine's proposer and path."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from speculant.config import SamplingParams, StructuredOutputsParams
from speculant.errors import SpeculantError
from speculant.sequence import Sequence

VERSION = 1


def params_dict(params: SamplingParams) -> dict:
    return asdict(params)


def params_from_dict(d: dict) -> SamplingParams:
    d = dict(d)
    structured = d.pop("structured_outputs", None)
    return SamplingParams(**d, structured_outputs=StructuredOutputsParams(**structured) if structured else None)


def record(request_id: str, endpoint: str | None, body: object, seqs: list[Sequence], engine: dict) -> dict:
    """One served request as its line's object; `engine`: the serving engine's description (model, proposer,
    k, speculative config, path)."""
    return {"version": VERSION, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "request_id": request_id, "endpoint": endpoint, "body": body, "engine": engine,
            "sequences": [{"index": i, "id": s.request_id, "prompt_ids": s.prompt_ids,
                           "params": params_dict(s.params), "output_ids": s.output_ids,
                           "finish_reason": s.finish_reason} for i, s in enumerate(seqs)]}


@dataclass
class RecordedSequence:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]


@dataclass
class Recorded:
    line: int
    request_id: str
    endpoint: str | None
    body: object
    engine: dict
    sequences: list[RecordedSequence]


def read_log(path: str | Path) -> list[Recorded]:
    """Every request of a record file; a line that is not a record fails with its number and why."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpeculantError(f"cannot read the record file {path}: {e}") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            records.append(parse_line(line, n, path))
    return records


def parse_line(line: str, n: int, path: str | Path) -> Recorded:
    where = f"{path}, line {n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpeculantError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise SpeculantError(f"{where}: a record is a JSON object, got {type(obj).__name__}")
    if obj.get("version") != VERSION:
        raise SpeculantError(f"{where}: record version {obj.get('version')!r}; this speculant reads version {VERSION}")
    for key, kind in (("request_id", str), ("sequences", list)):
        if not isinstance(obj.get(key), kind):
            raise SpeculantError(f"{where}: '{key}' is missing or not a {kind.__name__}")
    seqs = []
    for i, s in enumerate(obj["sequences"]):
        seqs.append(parse_sequence(s, f"{where}: sequences[{i}]"))
    return Recorded(n, obj["request_id"], obj.get("endpoint"), obj.get("body"), obj.get("engine") or {}, seqs)


def parse_sequence(s: object, where: str) -> RecordedSequence:
    if not isinstance(s, dict):
        raise SpeculantError(f"{where}: not an object")
    for key in ("prompt_ids", "output_ids"):
        ids = s.get(key)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise SpeculantError(f"{where}.{key}: a list of token ids is expected")
    if not isinstance(s.get("params"), dict):
        raise SpeculantError(f"{where}.params: an object of sampling parameters is expected")
    try:
        params = params_from_dict(s["params"])
    except (TypeError, SpeculantError) as e:
        raise SpeculantError(f"{where}.params: {e}") from None
    return RecordedSequence(s.get("index", 0), s["prompt_ids"], params, s["output_ids"])
