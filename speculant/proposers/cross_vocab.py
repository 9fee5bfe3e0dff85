"""A draft model of another tokenizer (Timor et al., ICML 2025, "lossless speculative decoding for heterogeneous
vocabularies"). The draft reads the target's text re-encoded by its own tokenizer (retokenize.py) and drafts by

- token-level intersection (TLI): it proposes only tokens whose strings both vocabularies hold, mapped to the
  target's ids (vocab_map.py); its distribution over them, renormalised, is the q it drew from, a distribution
  over the target's vocabulary zero elsewhere, so the acceptance rule stays exact for greedy and sampled rows;
- string level: its greedy text re-tokenized by the target's tokenizer, verified by exact match (coupling) — a
  deterministic draft, so greedy rows only; a sampled row then drafts by TLI where the kinds match, else not at
  all.

p_min and p_chain stop a draft from the draft's distributions before a draw, as in draft_model.py.
"""

from __future__ import annotations

import torch

from speculant.errors import SpeculantError
from speculant.models.attention import soft_cap
from speculant.models.loader import LoadedModel
from speculant.proposers.base import Proposal, Proposer, TargetHidden, pad_rows
from speculant.proposers.draft_vocab import HeadRows, draft_vocab_ids
from speculant.proposers.retokenize import DraftText, TextBridge, TextCodec
from speculant.proposers.vocab_map import VocabMap
from speculant.sampling import SamplingBatch, argmax
from speculant.sequence import Sequence

# The draft's cache holds this many tokens a target token: a draft tokenizer may need more for the same text.
DRAFT_LEN_FACTOR = 1.5


class CrossVocabProposer(Proposer):
    name = "draft_model"

    def __init__(self, draft: LoadedModel, target: LoadedModel, vmap: VocabMap, max_batch_size: int, max_len: int,
                 mapping: str | None = None, vocab_size: int = 0, p_min: float = 0.0, p_chain: float = 0.0):
        if draft.tokenizer is None or target.tokenizer is None:
            raise SpeculantError("a draft of another vocabulary needs both models' tokenizers")
        if draft.config.linear_layers:
            raise SpeculantError(f"{draft.source}: a hybrid draft cannot draft for a target of another vocabulary "
                                 "(its re-encoded text rolls back further than its recurrent state keeps)")
        self.model = draft.model
        self.mapping = mapping or vmap.mapping()
        if self.mapping == "refuse":
            raise SpeculantError(vmap.describe())
        self.vmap = vmap
        self.vocab_mapping = vmap.summary(self.mapping)
        self.p_min, self.p_chain = p_min, p_chain
        self.vocab_size = target.config.vocab_size  # q's width
        draft_ids, target_ids = vmap.draft_ids, vmap.target_ids
        if vocab_size:  # the reduced vocabulary (draft_vocab.py) on the target's side of the map
            added = list(target.eos_token_ids) + list(target.tokenizer.hf.get_added_tokens_decoder())
            kept = torch.isin(target_ids, draft_vocab_ids(vocab_size, self.vocab_size, added))
            draft_ids, target_ids = draft_ids[kept], target_ids[kept]
        # TLI for sampled rows: exact whatever the share; where the kinds differ there is no map.
        self.tli_sampled = vmap.same_kind and len(target_ids) > 0
        device = self.model.device
        self.map_draft, self.map_target = draft_ids.to(device), target_ids.to(device)
        self.head: HeadRows | None = None
        if self.mapping == "tli" or self.tli_sampled:
            self.head = HeadRows(self.model.lm_head, torch.unique(draft_ids))
            self.head_cols = torch.searchsorted(self.head.ids, self.map_draft)  # head columns, in the map's order
        self.bridge = TextBridge(TextCodec(target.tokenizer.hf), TextCodec(draft.tokenizer.hf))
        # String level drafts the draft's ids that are tokens (a model's rows may pass its tokenizer's).
        known = [i for i, b in enumerate(self.bridge.draft.bytes) if b is not None and i < draft.config.vocab_size]
        self.no_token = torch.ones(draft.config.vocab_size, dtype=torch.bool, device=device)
        self.no_token[known] = False
        self.draft_bos = draft.tokenizer.bos_id if draft.tokenizer.add_bos else None
        if self.draft_bos is not None:  # every sequence starts with it (add): the target's own is not fed again
            self.bridge.to_draft = {t: None if d == self.draft_bos else d for t, d in self.bridge.to_draft.items()}
        self.capacity = int(DRAFT_LEN_FACTOR * max_len)
        self.cache = self.model.new_cache(max_batch_size, self.capacity)
        self.free = list(range(max_batch_size))
        self.slot: dict[str, int] = {}
        self.text: dict[str, DraftText] = {}
        self.full: set[str] = set()  # sequences whose draft text outgrew the draft's cache: they draft no more

    def add(self, seq: Sequence) -> None:
        slot = self.slot[seq.request_id] = self.free.pop(0)
        self.cache.rollback(slot, 0)
        state = self.text[seq.request_id] = DraftText()
        if self.draft_bos is not None:
            state.stable.append(self.draft_bos)

    def remove(self, seq: Sequence) -> None:
        self.text.pop(seq.request_id)
        self.full.discard(seq.request_id)
        slot = self.slot.pop(seq.request_id)
        self.cache.release(slot)
        self.free.append(slot)

    def prefill(self, seqs: list[Sequence], target: TargetHidden) -> None:
        """The prompt's text up to the target's chunk, the chunk that ends it left to the first draft (as
        DraftModelProposer.prefill)."""
        rows = [(s, s.tokens[:start + n]) for s, start, n in zip(seqs, target.start, target.n_valid)
                if start + n < len(s.tokens) - 1]
        feeds = [(s, f) for s, tokens in rows if (f := self._sync(s, tokens, 0)) is not None]
        if feeds:
            self._feed([s for s, _ in feeds], [f for _, f in feeds])

    def row_mode(self, sb: SamplingBatch, b: int) -> str | None:
        """How row b drafts: "tli", "string" (greedy rows), or None (a sampled row with no map)."""
        if self.mapping == "tli":
            return "tli"
        if sb.keys[b] is None:
            return "string"
        return "tli" if self.tli_sampled else None

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        device = self.model.device
        feeds: dict[int, list[int]] = {}
        for b, (s, k) in enumerate(zip(seqs, ks)):
            if k and self.row_mode(sb, b) is not None:
                feed = self._sync(s, s.tokens, k)
                if feed:
                    feeds[b] = feed
        rows = sorted(feeds)
        if not rows:
            return Proposal.empty(len(seqs), device)
        sub = [seqs[b] for b in rows]
        hidden = self._feed(sub, [feeds[b] for b in rows])
        return self.draft_chain(sub, [ks[b] for b in rows], sb.select(rows), hidden).placed(rows, len(seqs))

    def _sync(self, seq: Sequence, tokens: list[int], k: int) -> list[int] | None:
        """Re-encode the target's new text for the draft and roll its cache back to what still holds → the
        draft tokens to feed (None: nothing to feed, or the row's text outgrew the cache)."""
        if seq.request_id in self.full:
            return None
        state = self.text[seq.request_id]
        keep, feed = self.bridge.sync(state, tokens)
        if keep + len(feed) + k > self.capacity:
            self.full.add(seq.request_id)
            return None
        self.cache.rollback(self.slot[seq.request_id], keep)
        return feed or None

    def _feed(self, seqs: list[Sequence], rows: list[list[int]]) -> torch.Tensor:
        """Append each row's draft tokens to its cache → the final hidden state of each row's last [B, 1, D]. A
        row far behind the others (a prompt) is fed its lag alone first: in theirs it would widen every row."""
        device = self.model.device
        width = sorted(len(r) for r in rows)[(len(rows) - 1) // 2]
        behind = [b for b, r in enumerate(rows) if len(r) > width]
        if len(rows) > 1 and behind:
            self._feed([seqs[b] for b in behind], [rows[b][:-width] for b in behind])
            rows = [r[-width:] if len(r) > width else r for r in rows]
        slots = torch.tensor([self.slot[s.request_id] for s in seqs], device=device)
        tokens, n_new = pad_rows(rows, device)
        hidden = self.model(tokens, self.cache, slots, n_new)
        return hidden[torch.arange(len(rows), device=device), n_new - 1][:, None]

    def _tli_logits(self, hidden: torch.Tensor, full: torch.Tensor | None) -> torch.Tensor:
        """The draft's logits over the map's tokens [B, 1, n], in the map's (target id) order."""
        if full is not None:
            return full.index_select(-1, self.map_draft)
        return soft_cap(self.head(hidden), self.model.cfg.logit_softcap).float().index_select(-1, self.head_cols)

    def draft_chain(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch, hidden: torch.Tensor) -> Proposal:
        """Up to ks[b] > 0 drafts for every row b, one draft pass a position, from the hidden state after each
        row's last token."""
        device = self.model.device
        B, K = len(seqs), max(ks)
        modes = [self.row_mode(sb, b) for b in range(B)]
        tli = [b for b in range(B) if modes[b] == "tli"]
        text = [b for b in range(B) if modes[b] == "string"]
        tli_at, text_at = torch.tensor(tli, device=device), torch.tensor(text, device=device)
        sb_tli = sb.select(tli) if tli else None
        slots = torch.tensor([self.slot[s.request_id] for s in seqs], device=device)
        n_draft = list(ks)
        chain = torch.ones(B, device=device)
        drafted, targets, qs = [], [], []
        for i in range(K):
            if max(n_draft) <= i:
                break
            full = self.model.logits(hidden).float() if text else None
            d = torch.zeros(B, dtype=torch.long, device=device)
            t = torch.zeros(B, dtype=torch.long, device=device)
            confidence = torch.zeros(B, device=device)
            if tli:
                logits = self._tli_logits(hidden, full)[tli_at]
                token, q = self.draw(logits, sb_tli.ahead(i), self.map_target)
                col = torch.searchsorted(self.map_target, token)
                t[tli_at], d[tli_at] = token, self.map_draft[col]
                qs.append(q)
                if self.p_min or self.p_chain:
                    own = torch.softmax(logits[:, 0], dim=-1)  # the draft's own, at temperature 1
                    confidence[tli_at] = self._rule(own, col, i, n_draft, tli)
            if text:
                logits = full[text_at, 0, :len(self.no_token)].masked_fill(self.no_token, float("-inf"))
                token = argmax(logits)
                d[text_at] = token
                if self.p_min or self.p_chain:
                    confidence[text_at] = self._rule(torch.softmax(logits, dim=-1), token, i, n_draft, text)
            if self.p_chain:
                chain = chain * confidence
                n_draft = [n if ok else min(n, i + 1) for n, ok in zip(n_draft, (chain >= self.p_chain).tolist())]
            drafted.append(d)
            targets.append(t)
            if max(n_draft) > i + 1:
                hidden = self.model(d[:, None], self.cache, slots)
                for s, token_id in zip(seqs, d.tolist()):
                    self.text[s.request_id].held.append(token_id)
        return self._proposal(seqs, n_draft, tli, text, drafted, targets, qs)

    def _rule(self, own: torch.Tensor, col: torch.Tensor, i: int, n_draft: list[int], rows: list[int]) -> torch.Tensor:
        """p_min (decided on the draft's distribution at i before its draw) for `rows`, whose n_draft it
        cuts in place → the draft's own probability of the token drawn at i (p_chain's factor)."""
        if self.p_min and i:
            for b, sure in zip(rows, (own.amax(dim=-1) >= self.p_min).tolist()):
                if not sure:
                    n_draft[b] = min(n_draft[b], i)
        return own.gather(-1, col[:, None]).squeeze(-1)

    def _proposal(self, seqs: list[Sequence], n_draft: list[int], tli: list[int], text: list[int],
                  drafted: list[torch.Tensor], targets: list[torch.Tensor], qs: list) -> Proposal:
        device = self.model.device
        B, K = len(seqs), len(drafted)
        if not K:
            return Proposal.empty(B, device)
        rows: list[list[int]] = [[] for _ in range(B)]
        if tli:
            t = torch.stack(targets, dim=1).tolist()
            for b in tli:
                rows[b] = t[b][:n_draft[b]]
        if text:
            d = torch.stack(drafted, dim=1).tolist()
            for b in text:
                rows[b] = self.bridge.target_tokens(seqs[b].tokens, d[b][:n_draft[b]])[:n_draft[b]]
        tokens, lengths = pad_rows([r + [0] * (K - len(r)) for r in rows], device)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
        q = None
        if qs and qs[0] is not None:  # None from draw: an all-greedy batch's deterministic drafts
            q = torch.zeros(B, K, self.vocab_size, dtype=qs[0].dtype, device=device)
            q[torch.tensor(tli, device=device)] = torch.stack(qs, dim=1)
        by_rule = None if q is None else [b in set(tli) for b in range(B)]
        return Proposal(tokens, lengths, q, by_rule=by_rule)
