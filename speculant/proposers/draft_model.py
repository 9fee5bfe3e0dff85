"""A smaller model of the same family drafts k tokens autoregressively, sampling each under the
request's own transforms, and reports q, the distribution it really drew from.

Rules that make the draft cheaper keep the output exact: a reduced vocabulary (draft_vocab.py: q is zero where
the draft cannot propose), and stopping where the draft is unsure of its next token (p_min, as llama.cpp's
--draft-p-min) or of the whole draft so far (p_chain, checked before the pass that would draft on, so it saves
that pass): whether position i is drafted is decided from the draft's distributions up to i and the tokens drawn
before i, never from the token drawn at i, so the token the target verifies is still drawn from q, and a position
left undrafted is the target's own draw.
"""

from __future__ import annotations

import warnings

import torch

from speculant.errors import SpeculantError
from speculant.models.attention import soft_cap
from speculant.models.loader import LoadedModel, stored_params
from speculant.prefix_cache import PrefixCache
from speculant.proposers.base import Proposal, Proposer, TargetHidden, pad_rows
from speculant.proposers.draft_vocab import HeadRows, draft_vocab_ids
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence


def warn_if_not_cheaper(target: LoadedModel, draft: LoadedModel) -> str | None:
    """A draft at least as large as its target costs as much a token as the target itself: every draft token
    then costs more than the pass that verifies it, and speculation is slower than plain decoding."""
    t, d = stored_params(target.model), stored_params(draft.model)
    if d < t:
        return None
    message = (f"the draft model ({d / 1e6:.0f}M parameters) is not smaller than the target ({t / 1e6:.0f}M): each "
               "draft token costs about a target pass, so speculation with it is slower than plain decoding; use a "
               "smaller model of the same family, or --ngram")
    warnings.warn(message, stacklevel=2)
    return message


def check_vocab(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the draft's tokens mean what the target's mean (False: both have tokenizers and they differ, a
    draft for cross_vocab.py); refuse a draft that cannot be compared or whose special tokens differ."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if target.tokenizer is None or draft.tokenizer is None:
        if tv != dv:
            raise SpeculantError(f"draft vocabulary size {dv} differs from the target's {tv} "
                                 "(no tokenizer to compare token strings)")
        return True
    t_vocab, d_vocab = target.tokenizer.vocab, draft.tokenizer.vocab
    if t_vocab != d_vocab:
        return False
    # Beyond the tokenizer's tokens, the embedding rows are padding: sizes may differ there.
    if min(tv, dv) < len(t_vocab):
        raise SpeculantError(f"model vocabulary sizes ({tv}, {dv}) are smaller than the tokenizer's {len(t_vocab)}")
    for name in ("bos_id", "eos_id"):
        if getattr(target.tokenizer, name) != getattr(draft.tokenizer, name):
            raise SpeculantError(f"draft and target special tokens differ: {name} "
                                 f"{getattr(draft.tokenizer, name)} vs {getattr(target.tokenizer, name)}")
    return True


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, draft: LoadedModel, target_vocab_size: int, max_batch_size: int, max_len: int,
                 vocab_size: int = 0, p_min: float = 0.0, p_chain: float = 0.0):
        self.model = draft.model
        self.vocab = target_vocab_size
        self.p_min, self.p_chain = p_min, p_chain
        self.head: HeadRows | None = None  # the reduced vocabulary's head; None: the whole vocabulary
        self.draft_ids: torch.Tensor | None = None  # the target ids the reduced head scores, sorted
        self.vocab_size = target_vocab_size  # q's width where the draft scores part of the vocabulary
        if vocab_size:
            added = list(draft.eos_token_ids)
            if draft.tokenizer is not None:
                added += [i for i in draft.tokenizer.hf.get_added_tokens_decoder()]
            ids = draft_vocab_ids(vocab_size, min(target_vocab_size, draft.config.vocab_size), added)
            self.head = HeadRows(self.model.lm_head, ids)
            kept = self.head.ids < target_vocab_size  # block-aligned rows may pass the target's vocabulary
            self.kept = None if bool(kept.all()) else kept
            self.draft_ids = self.head.ids[kept]
        self.cache = self.model.new_cache(max_batch_size, max_len)
        self.free = list(range(max_batch_size))
        self.slot: dict[str, int] = {}
        self.fed: dict[str, int] = {}  # tokens of the sequence the draft cache holds
        self.prefix_cache: PrefixCache | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache.row_bytes_per_token

    def use_prefix_cache(self, capacity_bytes: int) -> bool:
        self.prefix_cache = PrefixCache(capacity_bytes)
        return True

    def add(self, seq: Sequence) -> None:
        slot = self.slot[seq.request_id] = self.free.pop(0)
        self.fed[seq.request_id] = 0
        self.cache.rollback(slot, 0)
        if self.prefix_cache is not None:
            self.fed[seq.request_id] = self.prefix_cache.load(seq.tokens[:-1], self.cache, slot, count=False)

    def remove(self, seq: Sequence) -> None:
        slot = self.slot.pop(seq.request_id)
        fed = self.fed.pop(seq.request_id)
        if self.prefix_cache is not None and seq.finished and seq.finish_reason != "error":
            self.prefix_cache.store(seq.tokens[:fed], self.cache, slot)
        self.cache.release(slot)
        self.free.append(slot)

    def prefill(self, seqs: list[Sequence], target: TargetHidden) -> None:
        """Feed each sequence's prompt up to the end of the target's chunk, from where its draft row is (its
        own cached prefix may be shorter or longer than the target's). The chunk that ends the prompt is left
        to the first draft (catch_up): the first token does not wait for the draft, whose row may also lag by
        the answer before (tokens that prompt lookup drafted)."""
        rows = [s.tokens[self.fed[s.request_id]:start + n] if start + n < len(s.tokens) - 1 else []
                for s, start, n in zip(seqs, target.start, target.n_valid)]
        fed = [(s, r) for s, r in zip(seqs, rows) if r]
        if fed:
            self._feed([s for s, _ in fed], [r for _, r in fed])

    def _feed(self, seqs: list[Sequence], rows: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens to its sequence's draft cache → final hidden states [B, T, D]."""
        device = self.model.device
        slots = torch.tensor([self.slot[s.request_id] for s in seqs], device=device)
        tokens, n_new = pad_rows(rows, device)
        for s, r in zip(seqs, rows):
            self.fed[s.request_id] += len(r)
        return self.model(tokens, self.cache, slots, n_new)

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        device = self.model.device
        rows = [b for b, k in enumerate(ks) if k]
        if len(rows) < len(seqs):
            # Lookup first: the other rows have drafts of their own; these alone are fed and drafted.
            if not rows:
                return Proposal.empty(len(seqs), device)
            sub = self.propose([seqs[b] for b in rows], [ks[b] for b in rows], sb.select(rows))
            return sub.placed(rows, len(seqs))
        return self.draft_chain(seqs, ks, sb)

    def draft_chain(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        """Up to ks[b] > 0 drafts for every row b, one draft pass a position."""
        device = self.model.device
        slots = torch.tensor([self.slot[s.request_id] for s in seqs], device=device)
        hidden = self.catch_up(seqs)
        n_draft = list(ks)
        drafts, qs, fed = [], [], 0
        chain = torch.ones(len(seqs), device=device)  # the draft's probability of the drafts drawn so far
        for i in range(max(ks)):
            if max(n_draft) <= i:  # p_chain ended every row's draft at i: no head, no softmax there
                break
            logits = self._logits(hidden)  # over the draft's vocabulary: self.draft_ids, or all of it
            # The draft's own distribution (temperature 1, whatever the request's transforms), for the rules.
            confidence = torch.softmax(logits[:, 0], dim=-1) if self.p_chain or (self.p_min and i) else None
            if i and self.p_min:
                n_draft = self.stop_unsure(confidence, n_draft, i)
                if max(n_draft) <= i:
                    break
            token, q = self.draw(logits, sb.ahead(i), self.draft_ids)
            if self.p_chain:
                chain = chain * confidence.gather(-1, self._column(token)[:, None]).squeeze(-1)
                n_draft = self.end_chain(chain, n_draft, i)
            drafts.append(token)
            qs.append(q)
            if max(n_draft) > i + 1:
                hidden = self.model(drafts[-1][:, None], self.cache, slots)
                fed += 1
        for s in seqs:
            self.fed[s.request_id] += fed
        if not drafts:
            return Proposal.empty(len(seqs), device)
        q = None if qs[0] is None else torch.stack(qs, dim=1)  # None from draw: deterministic drafts
        return Proposal(torch.stack(drafts, dim=1), torch.tensor(n_draft, device=device), q)

    def catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each row what the draft has not seen yet (the verifier's last tokens) → the final hidden
        state of each row's newest token [B, 1, D]."""
        device = self.model.device
        unseen = [s.tokens[self.fed[s.request_id]:] for s in seqs]
        # A row far behind the others (a prompt's last chunk, an answer prompt lookup drafted) is fed its
        # lag in a pass of its own first: in theirs it would widen every row to its length.
        width = sorted(len(u) for u in unseen)[(len(unseen) - 1) // 2]
        behind = [b for b, u in enumerate(unseen) if len(u) > width]
        if len(seqs) > 1 and behind:
            self._feed([seqs[b] for b in behind], [unseen[b][:-width] for b in behind])
            unseen = [u[-width:] for u in unseen]
        hidden = self._feed(seqs, unseen)
        last = torch.tensor([len(u) - 1 for u in unseen], device=device)
        return hidden[torch.arange(len(seqs), device=device), last][:, None]

    def stop_unsure(self, confidence: torch.Tensor, n_draft: list[int], i: int) -> list[int]:
        """Rows whose draft gives its likeliest token at position i less than p_min draft i tokens at most.
        `confidence` [B, V] is the draft's own distribution at i, computed before anything is drawn there.
        Position 0 is always drafted: its pass is paid anyway (the draft reads the verifier's last token),
        and verifying one more token is ~free."""
        sure = confidence.amax(dim=-1) >= self.p_min
        return [n if ok else min(n, i) for n, ok in zip(n_draft, sure.tolist())]

    def end_chain(self, chain: torch.Tensor, n_draft: list[int], i: int) -> list[int]:
        """Rows whose drafts 0..i together have a draft probability `chain` [B] below p_chain draft no token
        after i. Decided before the pass that would draft position i + 1, so a draft that ends saves that
        pass, and from tokens drawn before i + 1 only: the token drawn at i + 1, had it been, is never looked at."""
        return [n if ok else min(n, i + 1) for n, ok in zip(n_draft, (chain >= self.p_chain).tolist())]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits [B, 1, N] over its vocabulary: the reduced one's ids (self.draft_ids), else
        the target's whole vocabulary."""
        if self.head is not None:
            scores = soft_cap(self.head(hidden), self.model.cfg.logit_softcap).float()
            return scores if self.kept is None else scores[..., self.kept]
        # Draft and target may pad their vocabularies differently: compare on the target's ids.
        logits = self.model.logits(hidden)
        V = logits.shape[-1]
        if V >= self.vocab:
            return logits[..., :self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - V), value=float("-inf"))

    def _column(self, token: torch.Tensor) -> torch.Tensor:
        """Target ids [B] drawn by the draft → their columns in its logits (draft_ids is sorted)."""
        return token if self.draft_ids is None else torch.searchsorted(self.draft_ids, token)

    def commit(self, seqs: list[Sequence], target: TargetHidden) -> None:
        # The draft fed its own guesses; only those the verifier kept are still valid.
        for s in seqs:
            if s.request_id in self.fed:
                self.fed[s.request_id] = min(self.fed[s.request_id], len(s.tokens) - 1)
                self.cache.rollback(self.slot[s.request_id], self.fed[s.request_id])
