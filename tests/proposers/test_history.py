"""The answer history: drafts from earlier answers, forgetting the oldest; output unchanged (greedy)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_greedy_lossless import GREEDY, PROMPTS, run

from speculant.config import SpeculativeConfig
from speculant.models.loader import load_model
from speculant.proposers.history import CONTEXT, END, HISTORY_BUCKET, AnswerHistory
from speculant.proposers.ngram import NgramProposer, SuffixIndex
from speculant.sampling import SamplingBatch
from speculant.sequence import SpecStats

LEAD = list(range(70, 70 + CONTEXT))  # a prompt's last tokens


def test_draft_continues_the_latest_answer_after_the_same_tokens():
    h = AnswerHistory(1000)
    h.learn([1, 2] + LEAD, list(range(10, 30)))
    h.learn([3] + LEAD, [11, 12] + list(range(40, 50)))
    assert h.draft(LEAD, 4) == [11, 12, 40, 41]  # a repeated prompt: the newer answer from its first token
    assert h.draft([5] + LEAD + [11], 3) == [12, 40, 41]
    assert h.draft(list(range(10, 18)), 30) == list(range(18, 30))  # the answer's end stops the draft
    assert h.draft(list(range(11, 18)), 3) == []  # fewer than CONTEXT agreeing tokens
    assert h.draft([0] + list(range(11, 18)), 3) == []
    # Drafts are answer tokens only: no context is followed by a prompt token or an end.
    assert all(h.tokens[at] in range(10, 50) for at in h.latest.values())


def test_forgets_the_oldest_half_beyond_max_tokens():
    h = AnswerHistory(100)
    answers = [list(range(100 * i, 100 * i + 12)) for i in range(12)]
    for i, answer in enumerate(answers):
        h.learn([i] * 20, answer)
        assert h.size <= 100 and len(h.tokens) == h.size + 1
    assert h.tokens[0] == END and h.tokens[-1] == END
    assert h.draft(answers[-1][:CONTEXT], 2) == answers[-1][CONTEXT:CONTEXT + 2]  # the newest is kept
    assert h.draft(answers[0][:CONTEXT], 2) == []  # the oldest is gone, from the index too
    # What is kept is indexed as if learned anew.
    rebuilt = AnswerHistory(1000)
    for lead, answer in h.entries:
        rebuilt.learn(lead, answer)
    assert rebuilt.tokens == h.tokens and rebuilt.latest == h.latest
    h.learn(LEAD, list(range(1000, 1200)))  # longer than the history: its start is kept
    assert list(h.entries) == [(LEAD, list(range(1000, 1000 + 100 - CONTEXT - 1)))]
    assert len(h.tokens) == 101


def test_repeated_requests_draft_their_earlier_answers(tiny_pair):
    target = load_model(tiny_pair[0])
    outputs = run(target, None, PROMPTS)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 6, "history_tokens": 10_000}
    assert SpeculativeConfig.parse(spec).proposer == "ngram+history"
    first, engine = run(target, spec, PROMPTS)
    assert engine.proposer.name == "ngram+history"
    assert engine.proposer.history.size == sum(len(p[-CONTEXT:]) + len(o) + 1 for p, o in zip(PROMPTS, outputs))
    # The same requests again: each continues its own earlier answer, from its first token on.
    before = engine.stats + SpecStats()  # a snapshot
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.generate(seqs)
    assert first == outputs and [s.output_ids for s in seqs] == outputs
    # Without the history the second run repeats the first's drafts (94 accepted in 66 passes; with it 124 in 36).
    again = engine.stats - before
    assert again.num_accepted_tokens > 1.2 * before.num_accepted_tokens
    assert again.target_passes < 0.7 * before.target_passes
    for prompt, answer in zip(PROMPTS, outputs):
        if len(prompt) >= CONTEXT:
            assert engine.proposer._draft(SuffixIndex(prompt, 6), 6) == (answer[:6], HISTORY_BUCKET)
    # A sampled row drafts as without the history: an earlier sample is a poor draft (see ngram.py).
    for params, same in ((replace(GREEDY, temperature=0.8, seed=3), True), (GREEDY, False)):
        seqs = [engine.add_request(p, params) for p in PROMPTS]
        sb = SamplingBatch.build([s.params for s in seqs], [None] * len(seqs), torch.device("cpu"))
        with_history = engine.proposer.propose(seqs, [6] * len(seqs), sb).tokens.tolist()
        assert (with_history == NgramProposer(1, 6).propose(seqs, [6] * len(seqs), sb).tokens.tolist()) == same


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},
                                  {"method": "draft_model", "num_speculative_tokens": 3, "lookup_first": True}])
def test_history_keeps_greedy_output(tiny_pair, spec):
    target = load_model(tiny_pair[0])
    spec |= {"model": str(tiny_pair[1])} if spec["method"] == "draft_model" else {}
    plain = run(target, None, PROMPTS)[0]
    _, engine = run(target, {**spec, "history_tokens": 5000}, PROMPTS)
    assert "history" in engine.proposer.name.split("+")
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS[::-1]]  # again, in another order and batch
    engine.generate(seqs)
    assert [s.output_ids for s in seqs] == plain[::-1]
    without = run(target, spec, PROMPTS + PROMPTS[::-1])[1]
    assert engine.stats.num_accepted_tokens > without.stats.num_accepted_tokens


def test_bench_runs_forget_between_jobs_unless_requests_repeat(tiny_pair):
    from speculant.bench.runner import Job, engine_runner, run_jobs
    from speculant.config import SamplingParams

    target = load_model(tiny_pair[0])
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 6, "history_tokens": 10_000})
    job = Job(["p"], "x", [PROMPTS[2]], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)])
    runner = engine_runner(target, spec, 1, 256)
    once, again = run_jobs([runner], [job, job])
    assert again.stats == once.stats  # the second run did not draft from the first one's answer
    repeated, = run_jobs([runner], [job], repeat=True)
    assert repeated.output_ids == once.output_ids
    assert repeated.stats["num_accepted_tokens"] > once.stats["num_accepted_tokens"]
