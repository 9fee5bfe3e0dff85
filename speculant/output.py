"""Output processing: a step's new tokens go into their sequence, which stops at a stop token, a stop string,
a grammar's end or max_tokens; the text is detokenized as it grows, and what a stream is sent holds back a
tail that could still grow into a stop string."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from speculant.sequence import Sequence, SpecStats, TokenLogprob

log = logging.getLogger("speculant")


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None = None
    error: Exception | None = None  # set when serving this sequence raised: it finished as "error"


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int, rank: bool = False) -> list[TokenLogprob]:
    """logits [N, V] at the positions that produced `tokens` [N] → each token's log-probability
    and the n_top most likely alternatives (and its rank, if asked)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])
    chosen = chosen_t[:, 0].tolist()
    ranks = ((logp > chosen_t).sum(-1) + 1).tolist() if rank else [None] * len(tokens)
    if not n_top:
        return [TokenLogprob(lp, [], r) for lp, r in zip(chosen, ranks)]
    top_lp, top_ids = logp.topk(n_top, dim=-1)
    return [TokenLogprob(lp, list(zip(ids, lps)), r)
            for lp, ids, lps, r in zip(chosen, top_ids.tolist(), top_lp.tolist(), ranks)]


def finish(seq: Sequence, reason: str) -> None:
    seq.finish_reason = reason
    seq.finish_time = time.perf_counter()


def failed(seq: Sequence, error: Exception) -> StepOutput:
    """Serving `seq` raised: it finishes as "error", the output carries the exception."""
    log.error("sequence %s failed: %s: %s", seq.request_id, type(error).__name__, error,
              exc_info=(type(error), error, error.__traceback__))
    finish(seq, "error")
    return StepOutput(seq, [], "", None, error)


class OutputProcessor:
    """Appends tokens for an engine whose model ends sequences at `eos_ids`."""

    def __init__(self, eos_ids: set[int]):
        self.eos_ids = eos_ids

    def commit(self, batch: list[Sequence], drafts: list[list[int]], accepted: list[list[int]], drafted: list[int],
               next_tokens: list[int], logits: torch.Tensor, stats: SpecStats) -> list[StepOutput]:
        """Each row's accepted drafts (indices into its `drafts`) and next token into its sequence, counted in
        its statistics and `stats`; a row that raises fails alone, the others' commits stand."""
        outputs = []
        for b, seq in enumerate(batch):
            try:
                path = accepted[b]
                new = [drafts[b][j] for j in path] + [next_tokens[b]]
                seq.stats.record(drafted[b], len(path))
                stats.record(drafted[b], len(path))
                # The logits that chose them: after the last token (0), after each accepted draft (j + 1).
                lps = None if seq.params.logprobs is None else token_logprobs(
                    logits[b, [0, *(j + 1 for j in path)]], new, seq.params.logprobs)
                outputs.append(self.append(seq, new, lps))
            except Exception as e:
                outputs.append(failed(seq, e))
        return outputs

    def append(self, seq: Sequence, new_ids: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
        """`new_ids` (a step's accepted drafts and next token) up to where the sequence stops."""
        kept = []
        stop_ids = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_ids)
        for tok in new_ids:
            if seq.grammar is not None:
                seq.grammar.commit(tok)
            seq.tokens.append(tok)
            kept.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
            if seq.detokenizer is not None:
                searched = len(seq.text)
                seq.text += seq.detokenizer.push([tok])
                if seq.params.stop and cut_at_stop_string(seq, searched):
                    break
            if tok in stop_ids or (seq.grammar is not None and seq.grammar.stopped):
                # A grammar that allows nothing more: the answer is complete (its only next token is EOS).
                finish(seq, "stop")
                break
            if seq.num_generated >= seq.max_tokens:
                finish(seq, "length")
                break
        if logprobs is not None:
            logprobs = logprobs[:len(kept)]
            seq.logprobs += logprobs
        return StepOutput(seq, kept, release_text(seq), logprobs)


def cut_at_stop_string(seq: Sequence, searched: int) -> bool:
    """If a stop string completed (in the text past `searched`, or straddling it), cut the text before it and
    finish the sequence."""
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, searched - longest + 1)
    hits = [(i, s) for s in seq.params.stop if (i := seq.text.find(s, start)) >= 0]
    if not hits:
        return False
    at, seq.stop_string = min(hits, key=lambda hit: hit[0])
    seq.text = seq.text[:at]
    finish(seq, "stop")
    return True


def release_text(seq: Sequence) -> str:
    """The text not yet streamed, holding back a tail that could still grow into a stop string."""
    end = len(seq.text)
    if not seq.finished:
        for stop in seq.params.stop:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if seq.text.endswith(stop[:n]):
                    end = min(end, len(seq.text) - n)
                    break
    end = max(end, seq.emitted)
    new, seq.emitted = seq.text[seq.emitted:end], end
    return new
