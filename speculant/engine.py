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
from speculant.drafting import Drafter
from speculant.errors import SpeculantError
from speculant.grammar_steps import constrain_logits, drop_forbidden, settle_grammars
from speculant.models import native
from speculant.models.loader import LoadedModel
from speculant.models.tokenizer import Detokenizer
from speculant.output import OutputProcessor, StepOutput, failed, finish, token_logprobs
from speculant.prefix_cache import prefix_cache_for
from speculant.prefix_store import open_store
from speculant.proposers import Proposal, Proposer, TargetHidden
from speculant.runner import ModelRunner, Scored
from speculant.sampling import SamplingBatch, request_key
from speculant.scheduler import DEFAULT_PREFILL_CHUNK, ChunkSizer, Prefill, Scheduler
from speculant.sequence import Sequence, SpecStats, TokenLogprob, check_prompt
from speculant.timing import EngineTiming, SpecMetricsLog
from speculant.verify import verify_proposal

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
    prefix_cache_dir: str | None = None  # where they are written too, for later processes (prefix_store.py)
    prefix_cache_disk_bytes: int | None = None  # the most that folder holds; None: prefix_store's default
    prefill_chunk: InitVar[int] = DEFAULT_PREFILL_CHUNK  # the most prompt tokens a pass feeds (scheduler/); 0: all
    first_token_alone: bool = True  # a request's first step drafts nothing (drafting.py)
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
        if hasattr(self.cache, "rollback_width"):  # a hybrid model's states: kept where a rollback may land
            self.cache.rollback_width = self.k + 1
        log.info("context %d tokens; the KV cache of %d rows %s %.2f GiB", self.max_model_len, self.max_batch_size,
                 "takes" if self.device.type == "cuda" else "may grow to (memory taken as rows fill)",
                 2 * self.cache.k.numel() * self.cache.k.element_size() / 2**30)
        self.runner = ModelRunner(self.model, self.cache, self.proposer.capture if self.proposer else None)
        self.drafter = Drafter(self.proposer, self.k, self.adaptive, self.first_token_alone, self.device)
        self.outputs = OutputProcessor(self.eos_ids)
        self.prefix_cache = prefix_cache_for(self.model, self.cache, self.proposer, self.prefix_cache_bytes)
        if self.prefix_cache is not None and self.prefix_cache_dir is not None:
            self.prefix_cache.disk = open_store(self.prefix_cache_dir, self.prefix_cache_disk_bytes, self.target,
                                                self.cache)
        elif self.prefix_cache_dir is not None:
            log.warning("prefix cache on disk is off: there is no prefix cache to keep (see above)")
        packed = self.model.packs_ragged
        self.scheduler = Scheduler(self.cache, self.max_model_len, self.prefix_cache,
                                   ChunkSizer(tile=native.tile_rows() if packed else 0), prefill_chunk, packed,
                                   last_chunk_decodes)
        self._ids = itertools.count()
        self.spec_log = SpecMetricsLog(self.log_interval_s)
        self._batch: list[Sequence] = []  # the rows _batch_tensors last built for
        # Sequences that ended outside a step's commit (a prefill that raised, max_tokens 0, background work given
        # up for live requests), reported by the next step.
        self._failed: list[StepOutput] = []
        self._grammars = None  # the structured-output compiler, built at the first constrained request

    @property
    def proposer_name(self) -> str | None:
        """The proposer that drafts; None where nothing does (no proposer, or k = 0)."""
        return self.proposer.name if self.proposer is not None and self.k else None

    @property
    def grammars(self):
        """The GrammarCompiler for this model's tokenizer (structured/grammar.py)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise SpeculantError("structured output needs the model's tokenizer (tokenizer.json)")
            from speculant.structured.grammar import GrammarCompiler

            try:
                self._grammars = GrammarCompiler(self.tokenizer, self.model.cfg.vocab_size, sorted(self.eos_ids))
            except ValueError as e:  # llguidance reads the tokenizer's pieces through its decoder
                raise SpeculantError(f"structured output cannot use this model's tokenizer: llguidance says "
                                     f"\"{e}\"") from None
        return self._grammars

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    speculate: bool = True, background: bool = False) -> Sequence:
        """`speculate` False: this sequence is decoded plainly (k = 0) beside the others; `background`: it takes
        only rows live sequences leave (the audit's re-decodes, scheduler.py)."""
        check_prompt(prompt_ids, self.model.cfg.vocab_size, self.max_model_len)
        # The request's own copy, validated again: changing the caller's object later changes nothing here.
        params = replace(params)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seq = Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            max_tokens=max_tokens,
            key=None if params.greedy else request_key(params.seed),
            detokenizer=Detokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None,
            speculate=speculate, background=background,
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
        batch = self.scheduler.serving()
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
            self.drafter.reset(seq)
            try:
                outputs += self._step([seq])[0]
            except Exception as row_error:
                self.cache.set_lengths([seq.slot], [seq.num_cached])
                outputs.append(failed(seq, row_error))
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
        if self.drafter.adapts(batch) and not scored.rode:  # chunks would read as a dearer pass
            self.adaptive.observe(StepRecord(proposal.bucket_list(), drafted, n_accepted, len(batch), t1 - t0,
                                             t2 - t1, proposal.tokens.shape[1] + 1))
        start = [s.num_cached for s in batch]
        n_valid = [len(s.tokens) - s.num_cached + n for s, n in zip(batch, n_accepted)]
        hidden = scored.hidden
        if proposal.parents is not None:
            hidden = self.runner.keep_branches(batch, accepted, hidden)
        outputs = self.commit(batch, proposal, accepted, drafted, next_tokens, scored.logits)
        self.drafter.commit(batch, TargetHidden(hidden, start, n_valid))
        self.timing.record(t1 - t0, t2 - t1, time.perf_counter() - t2, proposal.tokens.shape[1] + 1,
                           sum(len(o.new_token_ids) for o in outputs))
        if self.k:
            self.spec_log.maybe_log(self.stats)
        return outputs, scored

    def propose(self, batch: list[Sequence], sb: SamplingBatch) -> Proposal:
        return self.drafter.propose(batch, sb, bool(self.scheduler.foreground_waiting()))

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
        return verify_proposal(proposal, logits, sb)

    def commit(self, batch: list[Sequence], proposal: Proposal, accepted: list[list[int]], drafted: list[int],
               next_tokens: list[int], logits: torch.Tensor) -> list[StepOutput]:
        """Append each row's accepted drafts and next token; `drafted`: the drafts it could have accepted."""
        outputs = self.outputs.commit(batch, proposal.tokens.tolist(), accepted, drafted, next_tokens, logits,
                                      self.stats)
        for seq in batch:  # the target has seen every token but the newest (it is the next pass's input)
            seq.num_cached = len(seq.tokens) - 1
        self.cache.set_lengths([s.slot for s in batch], [s.num_cached for s in batch])
        return outputs

    # -- prompts ----------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Prefill, int]]:
        """Admit waiting sequences, feed the prompt chunks that go in passes of their own, move the sequences
        whose prompt is in to the running batch → the chunks that ride this step's pass."""
        given_up = self.scheduler.preempt_background()
        if given_up:  # live sequences wait for these rows
            self._failed += [StepOutput(seq, [], "") for seq in given_up]
            self._release_finished()
        for seq in self.scheduler.admit():
            if self.proposer is not None:
                self.proposer.add(seq)
        for group in self.scheduler.to_score():
            self.score_prompt(group)
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

    def score_prompt(self, group: Prefill) -> None:
        """Feed a group's whole prompt (all but its last token, as any prefill) in passes of its own, reading the
        log-probabilities of its tokens from the final hidden states: the same passes, cut the same way, alone
        or beside others, with or without a proposer, never from the prefix cache (Scheduler.admit). A group
        asking for no completion (max_tokens 0) finishes here."""
        lead, want = group.lead, group.lead.params.prompt_logprobs
        prompt, chunk = lead.tokens, self.scheduler.prefill_chunk or len(lead.tokens)
        scored: list[TokenLogprob | None] = [None]
        t0 = time.perf_counter()
        try:
            while lead.num_cached < len(prompt) - 1:
                start = lead.num_cached
                tokens = prompt[start:min(start + chunk, len(prompt) - 1)]
                hidden, read = self.runner.prompt_pass(lead.slot, tokens)
                scored += token_logprobs(self.model.head(hidden[0]), prompt[start + 1:start + 1 + len(tokens)],
                                         want, rank=True)
                self.show_chunk(group, len(tokens), read)
            group.started = True
        except Exception as e:
            self.fail_group(group, e)
            return
        finally:
            self.timing.target_s += time.perf_counter() - t0
        for seq in group.seqs:
            seq.prompt_logprobs = scored
            if seq.max_tokens == 0:
                finish(seq, "length")
                self._failed.append(StepOutput(seq, [], "", None if seq.params.logprobs is None else []))

    def fail_group(self, group: Prefill, error: Exception) -> None:
        """A prompt's chunk failed: its sequences finish as errors, reported by the next step."""
        self._failed += [failed(s, error) for s in group.seqs]

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

    def _release_finished(self) -> None:
        for seq in self.scheduler.release_finished():
            if self.proposer is not None:
                self.proposer.remove(seq)
