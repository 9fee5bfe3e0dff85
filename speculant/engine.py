"""The loop: propose → score → verify → commit, for a batch of sequences.

Plain decoding is the same loop with k = 0, so a baseline and a speculative run are measured
on one engine. Sequences join and leave between steps (continuous batching); each keeps its
own length in the KV cache, and rollback is a length change. Which sequences a step serves is the
scheduler's (scheduler/), the passes the runner's (runner.py), the tokens' way into their sequence the
output processor's (output.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field, replace

import torch

from speculant.adaptive import AdaptiveK, StepRecord
from speculant.config import SamplingParams
from speculant.context import cache_len, resolve_max_model_len
from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.kernels import inexact_reason
from speculant.models.loader import LoadedModel
from speculant.models.tokenizer import Detokenizer
from speculant.output import OutputProcessor, StepOutput, finish, token_logprobs
from speculant.prefix_cache import PrefixCache
from speculant.proposers import Proposal, Proposer, TargetHidden
from speculant.proposers.base import merged
from speculant.runner import ModelRunner, Scored
from speculant.sampling import SamplingBatch, request_key
from speculant.scheduler import DEFAULT_PREFILL_CHUNK, ChunkSizer, Prefill, Scheduler
from speculant.sequence import Sequence, SpecStats
from speculant.structured.steps import constrain_logits, drop_forbidden, forced_drafts, settle_grammars
from speculant.timing import EngineTiming
from speculant.verify import verify_logits, verify_tree_logits

log = logging.getLogger("speculant")


@dataclass
class Engine:
    target: LoadedModel
    proposer: Proposer | None = None
    num_speculative_tokens: int = 0
    max_batch_size: int = 8
    max_model_len: int | None = None
    log_interval_s: float = 10.0
    adaptive: AdaptiveK | None = None  # choose k per step; None: always num_speculative_tokens
    prefix_cache_bytes: int = 0  # keys and values kept for later requests (prefix_cache.py); 0: none
    prefill_chunk: InitVar[int] = DEFAULT_PREFILL_CHUNK  # the most prompt tokens a pass feeds (scheduler/); 0: all
    first_token_alone: bool = True  # a request's first step drafts nothing (_k_for)
    # With nothing decoding, a prompt's last chunk is fed by its first decode step (Scheduler.plan).
    last_chunk_decodes: InitVar[bool] = True
    stats: SpecStats = field(default_factory=SpecStats)
    timing: EngineTiming = field(default_factory=EngineTiming)

    def __post_init__(self, prefill_chunk: int, last_chunk_decodes: bool):
        self.model = self.target.model
        self.device = self.model.device
        self.tokenizer = self.target.tokenizer
        self.eos_ids = set(self.target.eos_token_ids)
        self.k = self.num_speculative_tokens if self.proposer is not None else 0
        self.max_model_len = resolve_max_model_len(self.model.cfg, self.max_model_len)
        extra = self.proposer.extra_nodes if self.proposer is not None else 0
        self.cache = self.model.new_cache(self.max_batch_size, cache_len(self.max_model_len, self.k, extra))
        log.info("context %d tokens; the KV cache of %d rows %s %.2f GiB", self.max_model_len, self.max_batch_size,
                 "takes" if self.device.type == "cuda" else "may grow to (memory taken as rows fill)",
                 2 * self.cache.k.numel() * self.cache.k.element_size() / 2**30)
        self.runner = ModelRunner(self.model, self.cache)
        self.outputs = OutputProcessor(self.eos_ids)
        self.prefix_cache = self._prefix_cache()
        packed = self.model.packs_ragged
        self.scheduler = Scheduler(self.cache, self.max_model_len, self.prefix_cache,
                                   ChunkSizer(tile=native.tile_rows() if packed else 0), prefill_chunk, packed,
                                   last_chunk_decodes)
        self._ids = itertools.count()
        self._last_log = time.perf_counter()
        self._logged = SpecStats()
        self._batch: list[Sequence] = []  # the rows _batch_tensors last built for
        self._failed: list[StepOutput] = []  # sequences whose prefill raised, reported by the next step
        self._grammars = None  # the structured-output compiler, built at the first constrained request

    def _prefix_cache(self) -> PrefixCache | None:
        """The target's store of past sequences, and the proposer's own, sharing the byte budget in
        proportion to what a token costs each. None where it is off, where the kernels are not row-exact (a
        hit would not give a cold prefill's bits), or where the proposer cannot start from a cached prefix
        (it reads the target's features of the whole prompt)."""
        if self.prefix_cache_bytes <= 0:
            return None
        inexact = inexact_reason(self.model, self.device)
        if inexact is not None:
            log.warning("prefix caching is off: %s, so a cached prefix's keys would not be a cold prefill's",
                        inexact)
            return None
        target = self.cache.row_bytes_per_token
        draft = self.proposer.kv_bytes_per_token if self.proposer is not None else 0
        share = self.prefix_cache_bytes * target // (target + draft)
        if self.proposer is not None and not self.proposer.use_prefix_cache(self.prefix_cache_bytes - share):
            log.info("prefix caching is off: the %s proposer reads the target's features of the whole prompt",
                     self.proposer.name)
            return None
        return PrefixCache(share)

    @property
    def grammars(self):
        """The GrammarCompiler for this model's tokenizer (structured/grammar.py)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise SpeculantError("structured output needs the model's tokenizer (tokenizer.json)")
            from speculant.structured.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model.cfg.vocab_size, sorted(self.eos_ids))
        return self._grammars

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Sequence:
        if not prompt_ids:
            raise SpeculantError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise SpeculantError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise SpeculantError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                 f"{self.max_model_len} (prompt plus at least one generated token)")
        # The request's own copy, validated again: changing the caller's object later changes nothing here.
        params = replace(params)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = min(params.max_tokens or room, room)
        seq = Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            max_tokens=max_tokens,
            key=None if params.greedy else request_key(params.seed),
            detokenizer=Detokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None,
        )
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.state(params.structured_outputs)
        self.scheduler.add(seq)
        return seq

    def add_requests(self, requests: Iterable[tuple[list[int], SamplingParams]],
                     request_ids: Iterable[str | None] | None = None) -> list[Sequence]:
        """All or none: a request refused (or a prompt that fails to arrive) withdraws the ones added before
        it, so a call that raises leaves the queue as it found it."""
        seqs: list[Sequence] = []
        ids = iter(request_ids) if request_ids is not None else itertools.repeat(None)
        try:
            for (prompt_ids, params), request_id in zip(requests, ids):
                seqs.append(self.add_request(prompt_ids, params, request_id))
        except BaseException:
            self.withdraw(seqs)
            raise
        return seqs

    def withdraw(self, seqs: list[Sequence]) -> None:
        """Abort those of `seqs` not finished yet: their slots and queue places are free again."""
        for seq in seqs:
            if not seq.finished:
                self.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._release_finished()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run steps until the given (already added) sequences are done; if a step raises (an interrupt),
        they are withdrawn, not left to decode for nobody."""
        try:
            while any(not s.finished for s in seqs):
                self.step()
        except BaseException:
            self.withdraw(seqs)
            raise
        return seqs

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One pass for the running batch. A sequence whose serving raises finishes as "error" (its
        StepOutput carries the exception); the others go on as if it had never been in the batch."""
        riders = self.schedule()
        failed, self._failed = self._failed, []
        batch = list(self.scheduler.running)
        if not batch:
            return failed
        t0 = time.perf_counter()
        try:
            outputs, scored = self._step(batch, riders)
            self.scheduler.chunk_sizer.observe_step(time.perf_counter() - t0, scored.rode, len(batch), scored.width,
                                                    scored.positions)
        except Exception as e:
            outputs = self._retry_alone(batch, riders, e)
        self._release_finished()
        return failed + outputs

    def _retry_alone(self, batch: list[Sequence], riders: list[tuple[Prefill, int]],
                     error: Exception) -> list[StepOutput]:
        """After a failed step: propose, score and verify change no sequence, so run each row alone to find the
        one that raises, from the cache lengths the sequences agree on (a scoring pass moves them on)."""
        log.warning("engine step over %d sequences failed (%s: %s); retrying them one by one",
                    len(batch), type(error).__name__, error)
        leads = [g.lead for g, _ in riders]  # a chunk that did not ride is fed again next step
        self.cache.set_lengths([s.slot for s in batch + leads], [s.num_cached for s in batch + leads])
        outputs = []
        for seq in batch:
            self._reset_proposer(seq)
            try:
                outputs += self._step([seq])[0]
            except Exception as row_error:
                self.cache.set_lengths([seq.slot], [seq.num_cached])
                outputs.append(self._fail(seq, row_error))
        return outputs

    def _step(self, batch: list[Sequence], riders: list[tuple[Prefill, int]] = ()) -> tuple[list[StepOutput], Scored]:
        """propose → score → verify → commit for `batch`, its pass carrying the prompt chunks `riders`
        (scheduler/); raises only before commit changed a sequence."""
        t0 = time.perf_counter()
        sb, slots = self._batch_tensors(batch)
        constrained = sb.grammars is not None
        if constrained:
            settle_grammars(batch)  # a step that raised may have left drafts pushed
        proposal = self.propose(batch, sb)
        if constrained:
            settle_grammars(batch)
            proposal = drop_forbidden(batch, proposal)
        t1 = time.perf_counter()
        scored = self.score(batch, slots, proposal, riders)
        t2 = time.perf_counter()
        logits = constrain_logits(batch, proposal, scored.logits) if constrained else scored.logits
        self.timing.grammar_s += time.perf_counter() - t2
        accepted, next_tokens = self.verify(proposal, logits, sb)
        n_accepted = [len(a) for a in accepted]
        drafted = proposal.depths()
        if self.adapts(batch) and not scored.rode:  # chunks would read as a dearer pass
            self.adaptive.observe(StepRecord(proposal.bucket_list(), drafted, n_accepted, len(batch), t1 - t0,
                                             t2 - t1, proposal.tokens.shape[1] + 1))
        start = [s.num_cached for s in batch]
        n_valid = [len(s.tokens) - s.num_cached + n for s, n in zip(batch, n_accepted)]
        hidden = scored.hidden
        if proposal.parents is not None:
            hidden = self.runner.keep_branches(batch, accepted, hidden)
        outputs = self.commit(batch, proposal, accepted, drafted, next_tokens, scored.logits)
        self._commit_proposer(batch, TargetHidden(hidden, start, n_valid))
        self.timing.record(t1 - t0, t2 - t1, time.perf_counter() - t2, proposal.tokens.shape[1] + 1,
                           sum(len(o.new_token_ids) for o in outputs))
        self._maybe_log()
        return outputs, scored

    def _commit_proposer(self, batch: list[Sequence], target: TargetHidden) -> None:
        if self.proposer is None:
            return
        try:
            self.proposer.commit(batch, target)
        except Exception:
            # The tokens are committed; only the drafts' state is in doubt: start it afresh.
            log.exception("proposer commit failed; resetting its state for %d sequences", len(batch))
            for seq in batch:
                self._reset_proposer(seq)

    def propose(self, batch: list[Sequence], sb: SamplingBatch) -> Proposal:
        """Each row's drafts for this step: as many as adaptive k plans (k of them without it), a grammar's
        forced tokens first."""
        if self.proposer is None:
            return Proposal.empty(len(batch), self.device)
        limits = [self._k_for(s, self.k) for s in batch]
        forced = forced_drafts(batch, limits) if sb.grammars is not None else None
        if forced is not None:
            limits = [0 if f else n for f, n in zip(forced, limits)]
        proposal = self._proposer_drafts(batch, limits, sb)
        return proposal if forced is None else merged(proposal, Proposal.from_lists(forced, self.device))

    def adapts(self, batch: list[Sequence]) -> bool:
        """Whether the adaptive policy chooses this step's drafts (and learns from the step)."""
        return self.adaptive is not None and len(batch) >= self.adaptive.from_batch

    def _proposer_drafts(self, batch: list[Sequence], limits: list[int], sb: SamplingBatch) -> Proposal:
        if self.adapts(batch):
            # With no request waiting for a slot the batch is done when its last row is (adaptive.batch_progress).
            remaining = None if self.scheduler.waiting else [s.max_tokens - s.num_generated for s in batch]
            return self.proposer.propose_adaptive(batch, limits, sb, self.adaptive, remaining)
        if not any(limits):
            return Proposal.empty(len(batch), self.device)
        return self.proposer.propose(batch, limits, sb)

    def _batch_tensors(self, batch: list[Sequence]) -> tuple[SamplingBatch, torch.Tensor]:
        """The batch's sampling transforms and cache slots [B], built again only when its rows change."""
        if len(batch) != len(self._batch) or any(a is not b for a, b in zip(batch, self._batch)):
            self._batch = []  # until both are built: a build that raises leaves nothing stale behind
            self._sb = SamplingBatch.build([s.params for s in batch], [s.key for s in batch], self.device,
                                           grammars=[s.grammar for s in batch])
            self._slots = torch.tensor([s.slot for s in batch], device=self.device)
            self._batch = list(batch)
        self._sb.positions = [s.num_generated for s in batch]
        return self._sb, self._slots

    def score(self, batch: list[Sequence], slots: torch.Tensor, proposal: Proposal,
              riders: list[tuple[Prefill, int]] = ()) -> Scored:
        """The target's pass over the batch's unseen tokens and drafts (runner.py), the prompt chunks `riders`
        riding it; a draft tree's pass has its own layout, so its chunks go in passes of their own."""
        if riders and proposal.parents is not None:
            for group, n in riders:
                self.prefill_apart(group, n)
            riders = ()
        scored = self.runner.score(batch, slots, proposal, [(g.lead.slot, g.next_chunk(n)) for g, n in riders])
        if riders:
            self.ride(riders, scored.chunk_hidden)
        return scored

    def verify(self, proposal: Proposal, logits: torch.Tensor,
               sb: SamplingBatch) -> tuple[list[list[int]], list[int]]:
        """(Each row's accepted drafts, as indices into its drafts; each row's next token.)"""
        if proposal.parents is None:
            n_accepted, next_tokens = verify_logits(proposal.tokens, proposal.n_draft, logits, proposal.q, sb,
                                                    proposal.by_rule)
            return [list(range(n)) for n in n_accepted], next_tokens
        paths, next_tokens = verify_tree_logits(proposal.tokens, proposal.n_draft, proposal.parents, logits, sb)
        return paths, next_tokens.tolist()

    def commit(self, batch: list[Sequence], proposal: Proposal, accepted: list[list[int]], drafted: list[int],
               next_tokens: list[int], logits: torch.Tensor) -> list[StepOutput]:
        """Append each row's accepted drafts and next token; `drafted`: the drafts it could have accepted."""
        outputs = []
        drafts = proposal.tokens.tolist()
        for b, seq in enumerate(batch):
            try:
                path = accepted[b]
                new = [drafts[b][j] for j in path] + [next_tokens[b]]
                seq.stats.record(drafted[b], len(path))
                self.stats.record(drafted[b], len(path))
                # The logits that chose them: after the last token (0), after each accepted draft (j + 1).
                lps = None if seq.params.logprobs is None else token_logprobs(
                    logits[b, [0, *(j + 1 for j in path)]], new, seq.params.logprobs)
                outputs.append(self.outputs.append(seq, new, lps))
            except Exception as e:  # this row alone: the others' commits stand
                outputs.append(self._fail(seq, e))
            # The target has seen every token but the newest (it is the next pass's input).
            seq.num_cached = len(seq.tokens) - 1
        self.cache.set_lengths([s.slot for s in batch], [s.num_cached for s in batch])
        return outputs

    # -- prompts ----------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Prefill, int]]:
        """Admit waiting sequences, feed the prompt chunks that go in passes of their own, move the sequences
        whose prompt is in to the running batch → the chunks that ride this step's pass."""
        for seq in self.scheduler.admit():
            if self.proposer is not None:
                self.proposer.add(seq)
        plan = self.scheduler.plan()
        for group, n in plan.apart:
            if not group.lead.finished:  # an earlier chunk of its prompt failed
                self.prefill_apart(group, n)
        self._release_finished()
        joined = self.scheduler.join_ready()
        if joined and self.adaptive:
            if len(self.scheduler.running) == 1:
                self.adaptive.new_request()
            else:
                self.adaptive.joined()
        return plan.riders

    def prefill_apart(self, group: Prefill, n: int) -> None:
        """Feed the next n tokens of a group's prompt in a pass of its own and show them to the proposer; a
        prompt that fails fails its own group alone."""
        t0 = time.perf_counter()
        try:
            self.show_chunk(group, n, self.runner.prefill(group.lead.slot, group.next_chunk(n)))
        except Exception as e:
            self.fail_group(group, e)
        self.timing.target_s += time.perf_counter() - t0

    def fail_group(self, group: Prefill, error: Exception) -> None:
        """A prompt's chunk failed: its sequences finish as errors, reported by the next step."""
        self._failed += [self._fail(s, error) for s in group.seqs]

    def ride(self, riders: list[tuple[Prefill, int]], hidden: torch.Tensor) -> None:
        """After a decode pass that carried prompt chunks (hidden [riders, T, D]): each group's chunk is in;
        a proposer that fails on one fails that group alone."""
        for (group, n), h in zip(riders, hidden):
            try:
                self.show_chunk(group, n, h[None, :n])
            except Exception as e:
                self.fail_group(group, e)

    def show_chunk(self, group: Prefill, n: int, hidden: torch.Tensor) -> None:
        """The target has fed a group's next n prompt tokens (their hidden states [1, n, D]): count them and
        show them to the proposer."""
        seqs, lead = group.seqs, group.lead
        start = lead.num_cached
        lead.num_cached += n
        group.started = True
        if self.proposer is not None:
            k = len(seqs)
            self.proposer.prefill(seqs, TargetHidden(hidden.expand(k, -1, -1), [start] * k, [n] * k))

    # -- helpers ----------------------------------------------------------------------------

    def _k_for(self, seq: Sequence, k: int) -> int:
        # The first token is what a caller waits on: it comes from a pass over the prompt's last token alone,
        # before the proposer has caught up on the prompt. A step yields accepted + 1 tokens: never draft past
        # max_tokens.
        if self.first_token_alone and seq.num_generated == 0:
            return 0
        return max(0, min(k, seq.max_tokens - seq.num_generated - 1))

    def _fail(self, seq: Sequence, error: Exception) -> StepOutput:
        log.error("sequence %s failed: %s: %s", seq.request_id, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        finish(seq, "error")
        return StepOutput(seq, [], "", None, error)

    def _reset_proposer(self, seq: Sequence) -> None:
        """Forget a sequence's draft state (it may be half updated): the proposer starts it over, so
        drafts get worse for a while, the output stays the same."""
        if self.proposer is not None and not seq.finished:
            self.proposer.remove(seq)
            self.proposer.add(seq)

    def _release_finished(self) -> None:
        for seq in self.scheduler.release_finished():
            if self.proposer is not None:
                self.proposer.remove(seq)

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < self.log_interval_s or not self.k:
            return
        interval = self.stats - self._logged
        if interval.num_drafts:
            log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
                     "tokens, Avg Draft acceptance rate: %.1f%%, Per-position acceptance rate: %s",
                     interval.mean_acceptance_length, interval.num_accepted_tokens, interval.num_draft_tokens,
                     100 * interval.acceptance_rate,
                     ", ".join(f"{a:.3f}" for a in interval.per_position_acceptance))
        self._logged = self.stats + SpecStats()  # a snapshot
        self._last_log = now
