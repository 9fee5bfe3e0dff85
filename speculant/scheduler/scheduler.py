"""The scheduler owns the requests' queues and the KV cache's rows: sequences waiting for a row, those whose
prompts are being fed (Prefill groups), the running batch; admission in the policy's order, each admitted
prompt starting from the longest prefix the prefix cache holds; each step's prompt chunks (chunks.py); and the
rows finished sequences leave, their keys kept for later requests. The engine runs the passes it plans.

Background sequences (the audit's re-decodes, Sequence.background) take only rows live traffic leaves: they are
admitted after every waiting live sequence, sit out the steps that feed a live prompt (a running row would
make that prompt ride decode passes in small chunks instead of passes of its own), and are given up
(finished as "abort") when live sequences wait for the rows they hold."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from speculant.models.kv_cache import KVCache
from speculant.output import finish
from speculant.prefix_cache import PrefixCache
from speculant.scheduler.chunks import ChunkSizer, Prefill, group_by_prompt, plan_chunks
from speculant.scheduler.policy import first_come
from speculant.sequence import Sequence


def reads_prefix_cache(seq: Sequence) -> bool:
    """A prompt scored for its log-probabilities is fed whole: the prefix cache holds keys, not logits."""
    return seq.params.prompt_logprobs is None


@dataclass
class ChunkPlan:
    apart: list[tuple[Prefill, int]] = field(default_factory=list)  # chunks fed in passes of their own
    riders: list[tuple[Prefill, int]] = field(default_factory=list)  # chunks riding the step's decode pass


class Scheduler:
    def __init__(self, cache: KVCache, max_model_len: int, prefix_cache: PrefixCache | None, chunk_sizer: ChunkSizer,
                 prefill_chunk: int, packed: bool, last_chunk_decodes: bool = True,
                 policy: Callable[[Iterable[Sequence]], list[Sequence]] = first_come):
        self.cache, self.max_model_len, self.prefix_cache = cache, max_model_len, prefix_cache
        self.chunk_sizer, self.prefill_chunk = chunk_sizer, prefill_chunk
        self.packed = packed  # passes run without their rows' padding (Transformer.packs_ragged)
        self.last_chunk_decodes = last_chunk_decodes  # with nothing decoding, a last chunk rides the first step
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Prefill] = []  # admitted, their prompts fed chunk by chunk
        self.running: list[Sequence] = []
        self.free_slots = list(range(cache.max_batch))
        self.background_paused = False  # this step serves no background row (plan)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def abort(self, request_id: str) -> None:
        """Finish the request's sequence as "abort", wherever it is (its row is freed by release_finished)."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
        for seq in self.running + [s for group in self.prefilling for s in group.seqs]:
            if seq.request_id == request_id:
                finish(seq, "abort")

    def foreground_waiting(self) -> list[Sequence]:
        return [s for s in self.waiting if not s.background]

    def spare_rows(self) -> int:
        """Rows free after every waiting sequence has one: what background work may take."""
        return len(self.free_slots) - len(self.waiting)

    def preempt_background(self) -> list[Sequence]:
        """Live sequences wait for rows that background ones hold: finish as many of those as it takes as
        "abort", those with the least work done first → them (their rows are freed by release_finished)."""
        need = len(self.foreground_waiting()) - len(self.free_slots)
        if need <= 0:
            return []
        held = [s for s in self.running + [s for g in self.prefilling for s in g.seqs]
                if s.background and not s.finished]
        given_up = sorted(held, key=lambda s: s.num_generated)[:need]
        for seq in given_up:
            finish(seq, "abort")
        return given_up

    def admit(self) -> list[Sequence]:
        """Give waiting sequences free cache rows, in the policy's order, live ones before background ones →
        those admitted. Each starts from the longest prefix of its prompt the prefix cache holds; the rest is fed
        in chunks."""
        if not (self.waiting and self.free_slots):  # a full batch with a long queue: no ordering every step
            return []
        background = [s for s in self.waiting if s.background]
        admitted = (self.policy(self.foreground_waiting()) + self.policy(background))[:len(self.free_slots)]
        taken = {id(s) for s in admitted}
        self.waiting = deque(s for s in self.waiting if id(s) not in taken)
        for seq in admitted:
            seq.slot = self.free_slots.pop(0)
            seq.num_cached = 0
            self.cache.rollback(seq.slot, 0)
            if hasattr(self.cache, "pin"):  # a hybrid model: keep the state at the prompt's end for the prefix cache
                self.cache.pin(seq.slot, len(seq.tokens) - 1)
        for group in group_by_prompt(admitted):
            lead = group.lead
            if self.prefix_cache is not None and reads_prefix_cache(lead):
                live = [(s.tokens[:s.num_cached], s.slot) for s in self.running + [g.lead for g in self.prefilling]]
                lead.num_cached = self.prefix_cache.load(lead.tokens[:-1], self.cache, lead.slot, live=live)
            for seq in group.seqs:
                seq.cached_tokens = lead.num_cached
            self.prefilling.append(group)
        return admitted

    def to_score(self) -> list[Prefill]:
        """Admitted groups whose prompt's log-probabilities are asked and not yet computed."""
        return [g for g in self.prefilling if g.lead.params.prompt_logprobs is not None
                and g.lead.prompt_logprobs is None and not g.lead.finished]

    def plan(self) -> ChunkPlan:
        """This step's prompt chunks: with nothing decoding, in passes of their own; beside decoding, riding the
        step's pass, as many tokens as the chunk sizer affords. With nothing decoding, a prompt's last chunk is
        fed by its first decode step (Prefill.tail): the pass that gives the first token feeds it too, one pass
        less before that token. Rows of other widths are padded where passes are not packed: there only a
        prompt alone does it."""
        self.background_paused = any(not g.lead.background for g in self.prefilling) or bool(
            self.foreground_waiting())
        serving = self.serving()
        decoding = bool(serving)
        if self.prefill_chunk == 0:  # no chunks: each prompt in one pass while the running streams wait
            chunk, decoding = self.max_model_len, False
        elif decoding:
            chunk = self.chunk_sizer.size(len(serving), self.prefill_chunk)
        else:
            chunk = self.prefill_chunk
        plan = ChunkPlan()
        prefilling = [g for g in self.prefilling if not (self.background_paused and g.lead.background)]
        to_first_step = self.last_chunk_decodes and not serving and (self.packed or len(prefilling) == 1)
        planned: dict[int, int] = {}  # tokens of each group's prompt planned before this chunk
        for group, n in plan_chunks(prefilling, chunk, decoding):
            before = planned.get(id(group), 0)
            planned[id(group)] = before + n
            if decoding and n:
                plan.riders.append((group, n))
            elif to_first_step and n and n == group.remaining - before and len(group.seqs) == 1:
                # The proposer sees the chunk at the step's commit; a draft model leaves a prompt's last chunk
                # to its first draft anyway (DraftModelProposer.prefill).
                group.tail, group.started = n, True
            else:
                plan.apart.append((group, n))
        return plan

    def serving(self) -> list[Sequence]:
        """The rows this step decodes: the running batch, but its background rows while a live prompt is fed or
        a live sequence waits (decided by plan)."""
        if not self.background_paused:
            return list(self.running)
        return [s for s in self.running if not s.background]

    def join_ready(self) -> list[Prefill]:
        """Groups whose prompt is in join the running batch (the others of a group copy its first row's)."""
        joined = [g for g in self.prefilling if g.done]
        self.prefilling = [g for g in self.prefilling if not g.done]
        for group in joined:
            lead, others = group.lead, group.seqs[1:]
            self.cache.share_prefix(lead.slot, [s.slot for s in others], lead.num_cached)
            for seq in others:
                seq.num_cached = lead.num_cached
            self.running += group.seqs
        # Rows in slot order, lowest slots first: a batch whose slots are contiguous reads the KV cache as a
        # view; any other order makes every layer gather (copy) the batch's keys and values.
        self.running.sort(key=lambda s: s.slot)
        return joined

    def release_finished(self) -> list[Sequence]:
        """Free finished sequences' rows, leaving what they computed to the prefix cache → those freed."""
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
        self.free_slots.sort()
        return finished
