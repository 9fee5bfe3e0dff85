"""The answer history: drafts from earlier answers, forgetting the oldest; output unchanged (greedy)."""

from __future__ import annotations

import pytest
from test_greedy_lossless import GREEDY, PROMPTS, run

from speculant.config import SpeculativeConfig
from speculant.models.loader import load_model
from speculant.proposers.history import CONTEXT, END, HISTORY_BUCKET, LEAD, MAX_MATCH, AnswerHistory


def test_draft_continues_the_latest_agreeing_answer():
    h = AnswerHistory(1000)
    h.learn([69, 70, 71], [1, 2, 3, 4, 5, 6, 7, 8])
    h.learn([72], [10, 2, 3, 4, 99, 98])
    assert h.draft([0, 2, 3, 4], 5) == ([99, 98], CONTEXT)  # the newer answer; its end stops the draft
    assert h.draft([2, 3, 4], 1) == ([99], CONTEXT)
    assert h.draft([3, 4], 5) == ([], 0)  # shorter than a context
    assert h.draft([7, 7, 7], 5) == ([], 0)
    # A repeated request finds its answer from the first token: the prompt's last tokens lead into it.
    assert h.draft([5, 69, 70, 71], 3) == ([1, 2, 3], CONTEXT)
    assert h.draft([70, 71, 1], 2) == ([2, 3], CONTEXT)
    # Drafts are answer tokens only: no context is followed by a prompt token.
    assert all(h.tokens[at] not in (69, 70, 71, 72, END) for at in h.latest.values())


def test_a_longer_agreement_wins_over_a_newer_one_and_sets_the_bucket():
    h = AnswerHistory(1000)
    h.learn([0], list(range(1, 13)))
    h.learn([0], [50, 4, 5, 6, 60])
    # Six agreeing tokens find the older answer; the match reaches back as far as the sequence agrees.
    assert h.draft([1, 2, 3, 4, 5, 6], 3) == ([7, 8, 9], 6)
    assert h.draft(list(range(1, 10)), 2) == ([10, 11], MAX_MATCH)
    assert h.draft([9, 4, 5, 6], 3) == ([60], CONTEXT)


def test_forgets_the_oldest_half_beyond_max_tokens():
    h = AnswerHistory(60)
    answers = [list(range(100 * i, 100 * i + 9)) for i in range(12)]
    for i, answer in enumerate(answers):
        h.learn([i + 1], answer)
        assert h.size <= 60 and len(h.tokens) == h.size + 1
    assert h.tokens[0] == END and h.tokens[-1] == END
    assert h.draft(answers[-1][:4], 2) == (answers[-1][4:6], 4)  # the newest is kept
    assert h.draft(answers[0][:4], 2) == ([], 0)  # the oldest is gone, from the index too
    # What is kept is indexed as if learned anew.
    rebuilt = AnswerHistory(1000)
    for lead, answer in h.entries:
        rebuilt.learn(lead, answer)
    assert rebuilt.tokens == h.tokens and rebuilt.latest == h.latest
    h.learn(list(range(20)), list(range(1000, 1100)))  # longer than the history: its start is kept
    assert list(h.entries) == [(list(range(20 - LEAD, 20)), list(range(1000, 1000 + 60 - LEAD - 1)))]
    assert len(h.tokens) == 61


def test_repeated_requests_draft_their_earlier_answers(tiny_pair):
    target = load_model(tiny_pair[0])
    outputs = run(target, None, PROMPTS)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 6, "history_tokens": 10_000}
    assert SpeculativeConfig.parse(spec).proposer == "ngram+history"
    first, engine = run(target, spec, PROMPTS)
    assert engine.proposer.name == "ngram+history"
    history = engine.proposer.history
    assert history.size == sum(len(p[-LEAD:]) + len(o) + 1 for p, o in zip(PROMPTS, outputs))
    # The same requests again: each continues its own earlier answer, from its first token on.
    before = engine.stats.num_accepted_tokens
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.generate(seqs)
    assert first == outputs and [s.output_ids for s in seqs] == outputs
    # The tiny model's answers end in loops, where lookup of the answer itself drafts as well: 72 drafts
    # kept the first time, 110 the second.
    assert engine.stats.num_accepted_tokens - before > 1.4 * before
    for prompt, answer in zip(PROMPTS, outputs):
        if len(prompt) >= CONTEXT:
            drafts, bucket = engine.proposer._draft(prompt, 6)
            assert drafts == answer[:6] and bucket >= HISTORY_BUCKET + CONTEXT


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
