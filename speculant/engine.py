"""The loop: propose → score → verify → commit, for a batch of sequences.

Plain decoding is the same loop with k = 0, so a baseline and a speculative run are measured
on one engine. Sequences join and leave between steps (continuous batching); each keeps its
own length in the KV cache, and rollback is a length change.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from speculant.adaptive import AdaptiveK, StepRecord
from speculant.config import SamplingParams
from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.kernels import inexact_reason
from speculant.models.llama import ModelConfig
from speculant.models.loader import LoadedModel
from speculant.models.tokenizer import Detokenizer
from speculant.prefix_cache import PrefixCache
from speculant.proposers import Proposal, Proposer, TargetHidden
from speculant.proposers.base import chain_padded, merged, pad_rows
from speculant.sampling import SamplingBatch, constrain, request_key
from speculant.scheduler import DEFAULT_PREFILL_CHUNK, ChunkSizer, Prefill, group_by_prompt, plan_chunks
from speculant.sequence import Sequence, SpecStats, TokenLogprob
from speculant.verify import verify_logits, verify_tree_logits

log = logging.getLogger("speculant")

DEFAULT_MAX_MODEL_LEN = 2048  # an Engine built directly; LLM and the CLI serve the model's own (context_for)
KV_MEMORY_SHARE = 0.25  # of the machine's memory: what the KV cache may take by default


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The context length served: the request, else a default that keeps the KV cache small,
    never beyond what the model was trained for."""
    if requested is not None and requested < 2:
        raise SpeculantError(f"max_model_len={requested} is too small")
    return min(requested or DEFAULT_MAX_MODEL_LEN, cfg.max_position_embeddings)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def context_for(cfg: ModelConfig, requested: int | None, max_batch_size: int, dtype: torch.dtype,
                device: torch.device) -> int:
    """The context served when none is asked for: the model's own, as far as a KV cache of
    max_batch_size rows fits in KV_MEMORY_SHARE of the machine's memory (agents' prompts are long)."""
    if requested is not None:
        return resolve_max_model_len(cfg, requested)
    own = cfg.max_position_embeddings
    per_row = kv_bytes_per_token(cfg, dtype)
    fits = int(KV_MEMORY_SHARE * memory_bytes(device)) // (max_batch_size * per_row)
    n = own if fits >= own else max(DEFAULT_MAX_MODEL_LEN, fits // 1024 * 1024)
    size = max_batch_size * n * per_row / 2**30
    if n < own:
        log.warning("context %d tokens (the model's own is %d): a KV cache of %d rows of %d tokens could grow "
                    "to %.1f GiB; this one to %.1f GiB. --max-model-len or --max-batch-size change it",
                    n, own, max_batch_size, own, max_batch_size * own * per_row / 2**30, size)
    return n


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """logits [N, V] at the positions that produced `tokens` [N] → each token's log-probability
    and the n_top most likely alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if not n_top:
        return [TokenLogprob(lp, []) for lp in chosen]
    top_lp, top_ids = logp.topk(n_top, dim=-1)
    return [TokenLogprob(lp, list(zip(ids, lps))) for lp, ids, lps in zip(chosen, top_ids.tolist(), top_lp.tolist())]


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None = None
    error: Exception | None = None  # set when serving this sequence raised: it finished as "error"


@dataclass
class EngineTiming:
    draft_s: float = 0.0
    target_s: float = 0.0
    other_s: float = 0.0
    grammar_s: float = 0.0  # the grammar masks on the target's logits (part of other_s)
    steps: int = 0
    tokens: int = 0
    # Target passes by width (tokens a row verifies: its drafts + 1) → [passes, seconds]: C(k+1)/C(1) as run.
    passes: dict[int, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**self.__dict__, "passes": {w: list(v) for w, v in self.passes.items()}}

    def pass_ms(self, width: int) -> float | None:
        n, s = self.passes.get(width, (0, 0.0))
        return 1e3 * s / n if n else None


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
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # the most prompt tokens a pass feeds (scheduler.py); 0: all
    first_token_alone: bool = True  # a request's first step drafts nothing (_k_for)
    # With nothing decoding, a prompt's last chunk is fed by its first decode step (_prefill_chunks).
    last_chunk_decodes: bool = True
    stats: SpecStats = field(default_factory=SpecStats)
    timing: EngineTiming = field(default_factory=EngineTiming)

    def __post_init__(self):
        self.model = self.target.model
        self.tokenizer = self.target.tokenizer
        self.eos_ids = set(self.target.eos_token_ids)
        self.k = self.num_speculative_tokens if self.proposer is not None else 0
        self.max_model_len = resolve_max_model_len(self.model.cfg, self.max_model_len)
        # Spare positions: a verify pass writes the drafts (k, a tree's other candidates too) and the
        # pending token before knowing how many stay.
        extra = self.proposer.extra_nodes if self.proposer is not None else 0
        self.cache = self.model.new_cache(self.max_batch_size, self.max_model_len + self.k + extra + 1)
        log.info("context %d tokens; the KV cache of %d rows %s %.2f GiB", self.max_model_len, self.max_batch_size,
                 "takes" if self.model.device.type == "cuda" else "may grow to (memory taken as rows fill)",
                 2 * self.cache.k.numel() * self.cache.k.element_size() / 2**30)
        self.free_slots = list(range(self.max_batch_size))
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Prefill] = []  # admitted, their prompts fed chunk by chunk
        self.chunk_sizer = ChunkSizer(tile=native.tile_rows() if self.model.packs_ragged else 0)
        self.running: list[Sequence] = []
        self.prefix_cache = self._prefix_cache()
        self._ids = itertools.count()
        self._last_log = time.perf_counter()
        self._logged = SpecStats()
        self.device = self.model.device
        self._batch: list[Sequence] = []  # the rows _batch_tensors last built for
        self._failed: list[StepOutput] = []  # sequences whose prefill raised, reported by the next step
        self._width = self._positions = 1  # the last decode pass's rows, without prompt chunks: widest, tokens
        self._rode = 0  # prompt tokens the last decode pass carried
        self._grammars = None  # the structured-output compiler, built at the first constrained request

    def _prefix_cache(self) -> PrefixCache | None:
        """The target's store of past sequences, and the proposer's own, sharing the byte budget in
        proportion to what a token costs each. None where it is off, where the kernels are not row-exact (a
        hit would not give a cold prefill's bits), or where the proposer cannot start from a cached prefix
        (it reads the target's features of the whole prompt)."""
        if self.prefix_cache_bytes <= 0:
            return None
        inexact = inexact_reason(self.model, self.model.device)
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
        self.waiting.append(seq)
        return seq

    def add_requests(self, requests: Iterable[tuple[list[int], SamplingParams]]) -> list[Sequence]:
        """All or none: a request refused (or a prompt that fails to arrive) withdraws the ones added before
        it, so a call that raises leaves the queue as it found it."""
        seqs: list[Sequence] = []
        try:
            for prompt_ids, params in requests:
                seqs.append(self.add_request(prompt_ids, params))
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
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
        for seq in self.running + [s for group in self.prefilling for s in group.seqs]:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
        self._release_finished()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

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
        self._admit()
        riders = self._prefill_chunks()
        failed, self._failed = self._failed, []
        batch = list(self.running)
        if not batch:
            return failed
        t0 = time.perf_counter()
        try:
            outputs = self._step(batch, riders)
            self.chunk_sizer.observe_step(time.perf_counter() - t0, self._rode, len(batch), self._width,
                                          self._positions)
        except Exception as e:
            # propose, score and verify change no sequence: run each row alone to find the one that raises,
            # from the cache lengths the sequences agree on (a scoring pass moves them on).
            log.warning("engine step over %d sequences failed (%s: %s); retrying them one by one",
                        len(batch), type(e).__name__, e)
            leads = [g.lead for g, _ in riders]  # a chunk that did not ride is fed again next step
            self.cache.set_lengths([s.slot for s in batch + leads], [s.num_cached for s in batch + leads])
            outputs = []
            for seq in batch:
                self._reset_proposer(seq)
                try:
                    outputs += self._step([seq])
                except Exception as row_error:
                    self.cache.set_lengths([seq.slot], [seq.num_cached])
                    outputs.append(self._fail(seq, row_error))
        self._release_finished()
        return failed + outputs

    def _step(self, batch: list[Sequence], riders: list[tuple[Prefill, int]] = ()) -> list[StepOutput]:
        """propose → score → verify → commit for `batch`, its pass carrying the prompt chunks `riders`
        (scheduler.py); raises only before commit changed a sequence."""
        t0 = time.perf_counter()
        sb, slots = self._batch_tensors(batch)
        constrained = sb.grammars is not None
        if constrained:
            self.settle_grammars(batch)  # a step that raised may have left drafts pushed
        proposal = self.propose(batch, sb)
        if constrained:
            self.settle_grammars(batch)
            proposal = self.drop_forbidden(batch, proposal)
        t1 = time.perf_counter()
        hidden, raw_logits = self.score(batch, slots, proposal, riders)
        t2 = time.perf_counter()
        logits = self.constrain(batch, proposal, raw_logits) if constrained else raw_logits
        self.timing.grammar_s += time.perf_counter() - t2
        accepted, next_tokens = self.verify(proposal, logits, sb)
        n_accepted = [len(a) for a in accepted]
        drafted = proposal.depths()
        if self.adapts(batch) and not self._rode:  # chunks would read as a dearer pass
            self.adaptive.observe(StepRecord(proposal.bucket_list(), drafted, n_accepted, len(batch), t1 - t0,
                                             t2 - t1, proposal.tokens.shape[1] + 1))
        start = [s.num_cached for s in batch]
        n_valid = [len(s.tokens) - s.num_cached + n for s, n in zip(batch, n_accepted)]
        if proposal.parents is not None:
            hidden = self.keep_branches(batch, accepted, hidden)
        outputs = self.commit(batch, proposal, accepted, drafted, next_tokens, raw_logits)
        if self.proposer is not None:
            try:
                self.proposer.commit(batch, TargetHidden(hidden, start, n_valid))
            except Exception:
                # The tokens are committed; only the drafts' state is in doubt: start it afresh.
                log.exception("proposer commit failed; resetting its state for %d sequences", len(batch))
                for seq in batch:
                    self._reset_proposer(seq)
        t3 = time.perf_counter()
        self.timing.draft_s += t1 - t0
        self.timing.target_s += t2 - t1
        self.timing.other_s += t3 - t2
        self.timing.steps += 1
        width = self.timing.passes.setdefault(proposal.tokens.shape[1] + 1, [0, 0.0])
        width[0] += 1
        width[1] += t2 - t1
        self.timing.tokens += sum(len(o.new_token_ids) for o in outputs)
        self._maybe_log()
        return outputs

    def propose(self, batch: list[Sequence], sb: SamplingBatch) -> Proposal:
        """Each row's drafts for this step: as many as adaptive k plans (k of them without it)."""
        if self.proposer is None:
            return Proposal.empty(len(batch), self.device)
        limits = [self._k_for(s, self.k) for s in batch]
        forced = self.forced_drafts(batch, limits) if sb.grammars is not None else None
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
            remaining = None if self.waiting else [s.max_tokens - s.num_generated for s in batch]
            return self.proposer.propose_adaptive(batch, limits, sb, self.adaptive, remaining)
        if not any(limits):
            return Proposal.empty(len(batch), self.device)
        return self.proposer.propose(batch, limits, sb)

    # -- structured output --------------------------------------------------------------------

    def forced_drafts(self, batch: list[Sequence], limits: list[int]) -> list[list[int]] | None:
        """The tokens each constrained row's grammar forces next (a key, its quotes, a brace), up to its
        draft limit: drafts that cost no model pass, verified like any other (the proposer drafts the
        rows that have none). None when no row has any."""
        forced = [s.grammar.forced(n) if s.grammar is not None else [] for s, n in zip(batch, limits)]
        return forced if any(forced) else None

    @staticmethod
    def settle_grammars(batch: list[Sequence]) -> None:
        for seq in batch:
            if seq.grammar is not None:
                seq.grammar.settle()

    def drop_forbidden(self, batch: list[Sequence], proposal: Proposal) -> Proposal:
        """A chain's drafts up to the first one its row's grammar forbids: the target's masked p gives it
        no mass, so it could never be accepted, and the masks past it mean nothing. (A tree's forbidden
        nodes stay: `constrain` leaves them unreachable.)"""
        if proposal.parents is not None:
            return proposal
        drafts, n_draft = proposal.tokens.tolist(), proposal.n_draft.tolist()
        kept = [n if s.grammar is None else s.grammar.valid_prefix(d[:n]) for s, d, n in zip(batch, drafts, n_draft)]
        if kept == n_draft:
            return proposal
        return replace(proposal, n_draft=torch.tensor(kept, device=proposal.n_draft.device))

    def constrain(self, batch: list[Sequence], proposal: Proposal, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits [B, k+1, V] under each constrained row's grammar: column 0 masked at the
        committed state, column j + 1 at the state after draft j and its ancestors. The same mask the
        proposer drew its drafts under, so p and q see the same transform."""
        from speculant.structured.grammar import free_bitmask, unpack

        B, T, V = logits.shape
        free = free_bitmask(V)
        drafts, n_draft = proposal.tokens.tolist(), proposal.n_draft.tolist()
        masks: list[bytes] = []
        for b, seq in enumerate(batch):
            if seq.grammar is None:
                masks += [free] * T
                continue
            parents = None if proposal.parents is None else proposal.parents[b][:n_draft[b]]
            row = seq.grammar.masks_along(drafts[b][:n_draft[b]], parents)
            masks += row + [free] * (T - len(row))
        allowed = unpack(masks, V).view(B, T, V).to(logits.device)
        return constrain(logits, allowed)

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
              riders: list[tuple[Prefill, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """One target pass over each row's unseen tokens plus its drafts, and the prompt chunks `riders`
        as rows of their own → (the final hidden states of every fed token of `batch` [B, T, D], the logits
        at each draft position and after the last [B, k+1, V])."""
        n_draft = proposal.n_draft.tolist()
        drafts = proposal.tokens.tolist()
        rows = [s.tokens[s.num_cached:] + d[:n] for s, d, n in zip(batch, drafts, n_draft)]
        tails = [len(s.tokens) - s.num_cached - 1 for s in batch]  # a prompt's last chunk, on its first step
        self._width = max(len(r) - t for r, t in zip(rows, tails))
        self._positions = sum(len(r) - t for r, t in zip(rows, tails))
        self._rode = sum(tails)
        if riders and proposal.parents is not None:  # a tree's pass has its own layout: chunks go apart
            for group, n in riders:
                self.prefill_apart(group, n)
            riders = ()
        if riders:
            rows += [g.next_chunk(n) for g, n in riders]
            slots = torch.cat((slots, torch.tensor([g.lead.slot for g, _ in riders], device=self.device)))
        tokens, n_new = pad_rows(rows, self.device)
        parents = None
        if proposal.parents is not None:
            # The unseen tokens are a chain; draft j hangs below the last of them or below its parent draft.
            T = tokens.shape[1]
            parents = []
            for row, tree, n in zip(rows, proposal.parents, n_draft):
                unseen = len(row) - n
                fed = chain_padded([], unseen) + [unseen - 1 if p < 0 else unseen + p for p in tree[:n]]
                parents.append(chain_padded(fed, T))
        hidden = self.model(tokens, self.cache, slots, n_new, parents)  # [B + riders, T, D]
        if riders:
            self._rode += sum(n for _, n in riders)
            self.ride(riders, hidden[len(batch):])
            hidden, rows = hidden[:len(batch)], rows[:len(batch)]
        # Row b's last unseen token predicts its first draft: positions n_unseen-1 .. n_new-1 (all of a
        # row that fed one unseen token and k drafts: decoding's usual pass).
        k = proposal.tokens.shape[1]
        scored = hidden
        if any(n != k or len(row) != k + 1 for row, n in zip(rows, n_draft)):
            at = [[min(len(row) - n - 1 + j, len(row) - 1) for j in range(k + 1)] for row, n in zip(rows, n_draft)]
            index = torch.tensor(at, device=self.device)[..., None].expand(-1, -1, hidden.shape[-1])
            scored = hidden.gather(1, index)  # [B, k+1, D]
        # In the lm_head's dtype: greedy verification reads bf16 logits as they are (the native argmax), the
        # rest converts where it computes with them.
        return hidden, self.model.lm_head(scored)

    def verify(self, proposal: Proposal, logits: torch.Tensor,
               sb: SamplingBatch) -> tuple[list[list[int]], list[int]]:
        """(Each row's accepted drafts, as indices into its drafts; each row's next token.)"""
        if proposal.parents is None:
            n_accepted, next_tokens = verify_logits(proposal.tokens, proposal.n_draft, logits, proposal.q, sb,
                                                    proposal.by_rule)
            return [list(range(n)) for n in n_accepted], next_tokens
        paths, next_tokens = verify_tree_logits(proposal.tokens, proposal.n_draft, proposal.parents, logits, sb)
        return paths, next_tokens.tolist()

    def keep_branches(self, batch: list[Sequence], accepted: list[list[int]], hidden: torch.Tensor) -> torch.Tensor:
        """After a draft tree's verification: move the accepted branch's keys and values where the
        sequence continues (the other candidates sat between them) → the pass's hidden states [B, T, D]
        reordered alike, so a proposer reads the branch's features in sequence order."""
        T = hidden.shape[1]
        order = [list(range(T)) for _ in batch]
        moved = False
        for b, (seq, path) in enumerate(zip(batch, accepted)):
            unseen = len(seq.tokens) - seq.num_cached
            moves = [(unseen + j, unseen + i) for i, j in enumerate(path) if j != i]
            if moves:
                src, dst = zip(*moves)
                self.cache.move(seq.slot, [seq.num_cached + p for p in src], [seq.num_cached + p for p in dst])
                for p, q in moves:
                    order[b][q] = p
                moved = True
        if not moved:
            return hidden
        index = torch.tensor(order, device=hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])
        return hidden.gather(1, index)

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
                outputs.append(self._append(seq, new, lps))
            except Exception as e:  # this row alone: the others' commits stand
                outputs.append(self._fail(seq, e))
            # The target has seen every token but the newest (it is the next pass's input).
            seq.num_cached = len(seq.tokens) - 1
        self.cache.set_lengths([s.slot for s in batch], [s.num_cached for s in batch])
        return outputs

    # -- helpers ----------------------------------------------------------------------------

    def _k_for(self, seq: Sequence, k: int) -> int:
        # The first token is what a caller waits on: it comes from a pass over the prompt's last token alone,
        # before the proposer has caught up on the prompt. A step yields accepted + 1 tokens: never draft past
        # max_tokens.
        if self.first_token_alone and seq.num_generated == 0:
            return 0
        return max(0, min(k, seq.max_tokens - seq.num_generated - 1))

    def _admit(self) -> None:
        """Give waiting sequences free cache rows: each starts from the longest prefix of its prompt the
        prefix cache holds, and the rest of its prompt is fed in chunks (scheduler.py)."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.num_cached = 0
            self.cache.rollback(seq.slot, 0)
            if self.proposer is not None:
                self.proposer.add(seq)
            admitted.append(seq)
        for group in group_by_prompt(admitted):
            lead = group.lead
            if self.prefix_cache is not None:
                live = [(s.tokens[:s.num_cached], s.slot) for s in self.running + [g.lead for g in self.prefilling]]
                lead.num_cached = self.prefix_cache.load(lead.tokens[:-1], self.cache, lead.slot, live=live)
            for seq in group.seqs:
                seq.cached_tokens = lead.num_cached
            self.prefilling.append(group)

    def _prefill_chunks(self) -> list[tuple[Prefill, int]]:
        """Feed prompt chunks: with nothing decoding, in passes of their own; beside decoding, the chunks are
        returned to ride in this step's pass. Sequences whose prompt is all in join the running batch."""
        decoding = bool(self.running)
        if self.prefill_chunk == 0:  # no chunks: each prompt in one pass while the running streams wait
            chunk, decoding = self.max_model_len, False
        elif decoding:
            chunk = self.chunk_sizer.size(len(self.running), self.prefill_chunk)
        else:
            chunk = self.prefill_chunk
        riders = []
        # With nothing decoding, a prompt's last chunk is fed by its first decode step: the pass that gives the
        # first token feeds it too, one pass less before that token. Rows of other widths are padded where
        # passes are not packed: there only a prompt alone does it.
        to_first_step = (self.last_chunk_decodes and not self.running
                         and (self.model.packs_ragged or len(self.prefilling) == 1))
        for group, n in plan_chunks(self.prefilling, chunk, decoding):
            if group.lead.finished:  # an earlier chunk of its prompt failed
                continue
            if decoding and n:
                riders.append((group, n))
            elif to_first_step and n and n == group.remaining and len(group.seqs) == 1:
                # The proposer sees the chunk at the step's commit; a draft model leaves a prompt's last chunk
                # to its first draft anyway (DraftModelProposer.prefill).
                group.tail, group.started = n, True
            else:
                self.prefill_apart(group, n)
        self._release_finished()
        joined = [g for g in self.prefilling if g.done]
        self.prefilling = [g for g in self.prefilling if not g.done]
        for group in joined:
            self._join(group)
        # Rows in slot order, lowest slots first: a batch whose slots are contiguous reads the KV cache
        # as a view; any other order makes every layer gather (copy) the batch's keys and values.
        self.running.sort(key=lambda s: s.slot)
        if joined and self.adaptive:
            if len(self.running) == 1:
                self.adaptive.new_request()
            else:
                self.adaptive.joined()
        return riders

    def _join(self, group: Prefill) -> None:
        """A group's prompt is in its first row: the others copy it, and all join the running batch."""
        lead = group.lead
        others = group.seqs[1:]
        self.cache.share_prefix(lead.slot, [s.slot for s in others], lead.num_cached)
        for seq in others:
            seq.num_cached = lead.num_cached
        self.running += group.seqs

    def prefill(self, group: Prefill, n: int) -> None:
        """Feed the next n tokens of new sequences' shared prompt into the first one's row in a pass of its
        own, and show them to the proposer. A chunk computes each position as any other pass would
        (prepare_pass), so the prompt's keys do not depend on how it was cut, nor on which requests
        arrived with it."""
        t0 = time.perf_counter()
        lead = group.lead
        hidden = torch.zeros(1, 0, self.model.cfg.dim, device=self.device, dtype=self.model.dtype)
        if n:
            tokens, n_new = pad_rows([group.next_chunk(n)], self.device)
            hidden = self.model(tokens, self.cache, torch.tensor([lead.slot], device=self.device), n_new)
        self.show_chunk(group, n, hidden)
        self.timing.target_s += time.perf_counter() - t0

    def prefill_apart(self, group: Prefill, n: int) -> None:
        """prefill, and a prompt that fails fails its own group alone."""
        try:
            self.prefill(group, n)
        except Exception as e:
            self.fail_group(group, e)

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

    def _append(self, seq: Sequence, new_ids: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
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
                if seq.params.stop and self._cut_at_stop_string(seq, searched):
                    break
            if tok in stop_ids or (seq.grammar is not None and seq.grammar.stopped):
                # A grammar that allows nothing more: the answer is complete (its only next token is EOS).
                self._finish(seq, "stop")
                break
            if seq.num_generated >= seq.max_tokens:
                self._finish(seq, "length")
                break
        if logprobs is not None:
            logprobs = logprobs[:len(kept)]
            seq.logprobs += logprobs
        return StepOutput(seq, kept, self._release_text(seq), logprobs)

    def _cut_at_stop_string(self, seq: Sequence, searched: int) -> bool:
        """If a stop string completed, cut the text before it and finish the sequence."""
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, searched - longest + 1)
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[:min(hits)]
        self._finish(seq, "stop")
        return True

    @staticmethod
    def _release_text(seq: Sequence) -> str:
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

    def _fail(self, seq: Sequence, error: Exception) -> StepOutput:
        log.error("sequence %s failed: %s: %s", seq.request_id, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        self._finish(seq, "error")
        return StepOutput(seq, [], "", None, error)

    def _reset_proposer(self, seq: Sequence) -> None:
        """Forget a sequence's draft state (it may be half updated): the proposer starts it over, so
        drafts get worse for a while, the output stays the same."""
        if self.proposer is not None and not seq.finished:
            self.proposer.remove(seq)
            self.proposer.add(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

    def _release_finished(self) -> None:
        """Free finished sequences' rows, leaving what they computed to the prefix cache."""
        finished = [s for s in self.running if s.finished]
        for group in self.prefilling:
            live = [s for s in group.seqs if not s.finished]
            if live and group.lead.finished:  # the next one takes over the prompt fed so far
                self.cache.share_prefix(group.lead.slot, [live[0].slot], group.lead.num_cached)
                live[0].num_cached = group.lead.num_cached
            finished += [s for s in group.seqs if s.finished]
            group.seqs = live
        self.prefilling = [g for g in self.prefilling if g.seqs]
        for seq in finished:
            if seq in self.running:
                self.running.remove(seq)
            if self.prefix_cache is not None and seq.finish_reason != "error":
                self.prefix_cache.store(seq.tokens[:seq.num_cached], self.cache, seq.slot)
            self.cache.release(seq.slot)
            self.free_slots.append(seq.slot)
            if self.proposer is not None:
                self.proposer.remove(seq)
        self.free_slots.sort()

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
