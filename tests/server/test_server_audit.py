"""The lossless audit: `serve --audit RATE` decodes greedy and seeded requests again without speculation and
counts the results in /metrics; a verifier that gets one token wrong is reported with its position, in the
server and by `speculant audit` over a `serve --record` file; bad flags and logs fail with precise errors."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from conftest import server_engine
from mutants import flip_verified_token
from test_server import grew, live_server, metric, scrape

from speculant.cli import main
from speculant.server.bridge.auditor import AuditSettings
from speculant.server.http.app import create_app

MAX_MODEL_LEN = 512
PROMPT = "Repeat after me: one two three four five, one two three four five, one two three four five,"
# The bundled model served as these flags load it: fp32, its weights dequantized (conftest.server_engine).
REPLAY_FLAGS = ["--dtype", "float32", "-q", "none", "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", "8"]


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, MAX_MODEL_LEN)


def complete(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 24, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Count from one to ten in words."}], "max_tokens": 24,
        "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def serve_requests(base: str) -> list[dict]:
    """Greedy and seeded requests (5 sequences, auditable) and one unseeded sampled request (not auditable)."""
    return [complete(base, temperature=0), chat(base, temperature=0),
            complete(base, temperature=0.8, seed=3, n=2), chat(base, temperature=0.7, seed=5),
            complete(base, temperature=0.8)]


def audited(base: str, before: dict, total: int, timeout_s: float = 180) -> dict:
    """/metrics once `total` audit results more than `before` are counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(base)
        done = sum(grew(before, after, "speculant:audit_requests_total", result=r)
                   for r in ("match", "mismatch", "skipped"))
        if done >= total or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def test_audit_at_rate_one_matches_every_greedy_and_seeded_request(engine):
    with live_server(create_app(engine, ["smollm"], audit=AuditSettings(rate=1.0))) as base:
        before = scrape(base)
        answers = serve_requests(base)
        after = audited(base, before, 6)
    assert answers[0]["speculative_stats"]["num_accepted_tokens"] > 0  # speculation ran and was kept
    assert grew(before, after, "speculant:audit_requests_total", result="match") == 5
    assert grew(before, after, "speculant:audit_requests_total", result="mismatch") == 0
    assert grew(before, after, "speculant:audit_requests_total", result="skipped") == 1
    assert grew(before, after, "speculant:audit_skipped_total", reason="unseeded") == 1
    assert metric(after, "speculant:num_requests_running") == 0  # the audit's rows are not live load


def test_a_verifier_that_flips_one_token_is_reported_with_its_position(engine, monkeypatch, caplog):
    flip_verified_token(monkeypatch, 6)
    with caplog.at_level(logging.WARNING, logger="speculant.audit"):
        with live_server(create_app(engine, ["smollm"], audit=AuditSettings(rate=1.0))) as base:
            before = scrape(base)
            answer = complete(base, temperature=0)
            after = audited(base, before, 1)
    assert grew(before, after, "speculant:audit_requests_total", result="mismatch") == 1
    warning = [r.getMessage() for r in caplog.records if "audit mismatch" in r.getMessage()]
    ids = answer["choices"][0]["token_ids"]
    assert len(warning) == 1 and f"request {answer['id']}-0 " in warning[0]
    assert "proposer ngram" in warning[0] and "float32, weights none, kernels" in warning[0]
    assert f"first differing output position 6: speculative token {ids[6]}, plain token" in warning[0]


def test_record_then_audit_round_trip(engine, smollm_path, tmp_path, capsys):
    path = tmp_path / "record.jsonl"
    with live_server(create_app(engine, ["smollm"], audit=AuditSettings(record=str(path)))) as base:
        answers = serve_requests(base)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == [a["id"] for a in answers]
    assert lines[0]["endpoint"] == "/v1/completions" and lines[0]["body"]["prompt"] == PROMPT
    assert lines[1]["endpoint"] == "/v1/chat/completions" and lines[1]["engine"]["proposer"] == "ngram"
    assert [s["output_ids"] for s in lines[2]["sequences"]] == [c["token_ids"] for c in answers[2]["choices"]]
    code = main(["audit", str(path), "--model", str(smollm_path), *REPLAY_FLAGS, "--ngram", "--respec"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "match 5, mismatch 0, skipped 1 (1 unseeded)" in out


def test_audit_of_a_mutants_record_reports_the_mismatch_and_fails(engine, smollm_path, tmp_path, monkeypatch, capsys):
    path = tmp_path / "record.jsonl"
    flip_verified_token(monkeypatch, 4)
    with live_server(create_app(engine, ["smollm"], audit=AuditSettings(record=str(path)))) as base:
        answer = complete(base, temperature=0)
    monkeypatch.undo()
    code = main(["audit", str(path), "--model", str(smollm_path), *REPLAY_FLAGS, "--no-speculation"])
    out = capsys.readouterr().out
    assert code == 3, out
    ids = answer["choices"][0]["token_ids"]
    assert (f"MISMATCH {answer['id']} choice 0: plain decoding differs from the recorded output, first differing "
            f"output position 4: speculative token {ids[4]}, plain token") in out
    assert "match 0, mismatch 1, skipped 0" in out


# -- bad flags and logs -----------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["1.5", "-0.1", "nan", "often"])
def test_serve_refuses_an_audit_rate_outside_zero_to_one(rate, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--audit", rate])
    assert e.value.code == 2
    assert f"argument --audit: the share of requests audited is a number from 0 to 1 (0.01: one in a hundred; 0: " \
           f"off), got '{rate}'" in capsys.readouterr().err


def test_serve_refuses_a_record_file_it_cannot_append_to(tmp_path, capsys):
    assert main(["serve", "--record", str(tmp_path / "missing" / "r.jsonl"), "--port", "1"]) == 1
    assert f"--record cannot append to {tmp_path / 'missing' / 'r.jsonl'}: No such file or directory" in \
        capsys.readouterr().err


GOOD = {"version": 1, "request_id": "cmpl-1", "sequences": [
    {"index": 0, "prompt_ids": [1, 2], "params": {"temperature": 0, "max_tokens": 4}, "output_ids": [5]}]}


@pytest.mark.parametrize("line, why", [
    ("not json", "line 2: not JSON (Expecting value at column 1)"),
    ("[1, 2]", "line 2: a record is a JSON object, got list"),
    (json.dumps({**GOOD, "version": 7}), "line 2: record version 7; this speculant reads version 1"),
    (json.dumps({**GOOD, "request_id": None}), "line 2: 'request_id' is missing or not a str"),
    (json.dumps({**GOOD, "sequences": [{**GOOD["sequences"][0], "prompt_ids": [1, "x"]}]}),
     "line 2: sequences[0].prompt_ids: a list of token ids is expected"),
    (json.dumps({**GOOD, "sequences": [{**GOOD["sequences"][0], "params": {"temperature": -1}}]}),
     "line 2: sequences[0].params: invalid sampling parameter temperature=-1"),
    (json.dumps({**GOOD, "sequences": [{**GOOD["sequences"][0], "params": {"warmth": 1}}]}),
     "line 2: sequences[0].params: "),
])
def test_audit_names_the_bad_line_of_a_log(tmp_path, capsys, line, why):
    path = tmp_path / "record.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    assert main(["audit", str(path)]) == 1
    assert f"error: {path}, {why}" in capsys.readouterr().err


def test_audit_says_when_it_cannot_read_the_log(tmp_path, capsys):
    assert main(["audit", str(tmp_path / "none.jsonl")]) == 1
    assert f"error: cannot read the record file {tmp_path / 'none.jsonl'}: [Errno 2] No such file or directory" in \
        capsys.readouterr().err
