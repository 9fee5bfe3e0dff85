"""The target's passes for an engine step: a batch's unseen tokens and drafts scored in one pass (prompt
chunks riding as rows of their own), a prompt chunk in a pass of its own, and a verified tree's branch moved
where its sequence continues. It reads and writes the KV cache; which rows and chunks go in is the
scheduler's, what the scores mean the verifier's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.models.kv_cache import KVCache
from speculant.models.llama import Transformer
from speculant.proposers import Proposal
from speculant.proposers.base import chain_padded, pad_rows
from speculant.sequence import Sequence


@dataclass
class Scored:
    # [B, T, D]: the final hidden states of every token a row fed (the captured layers' [B, T, n·D])
    hidden: torch.Tensor
    logits: torch.Tensor  # [B, k+1, V]: at each draft position and after the last
    chunk_hidden: torch.Tensor | None  # [chunks, T, D]: the riding prompt chunks' (their first n of T)
    width: int  # the widest decoding row (its unseen tokens and drafts), prompt tails left out
    positions: int  # the decoding rows' real tokens, prompt tails left out
    rode: int  # prompt tokens the pass carried: chunks, and prompt tails fed by a first step


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, capture: tuple[int, ...] | None = None):
        self.model, self.cache = model, cache
        self.device = model.device
        # The layers whose input a proposer reads (EAGLE-3): their hidden states take the final ones' place in
        # what the passes hand on (Scored.hidden, prefill's), the logits still from the final ones.
        self.capture = capture

    def forward(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's pass → (final hidden states, what the proposer reads)."""
        if self.capture is None:
            hidden = self.model(*args)
            return hidden, hidden
        return self.model(*args, capture=self.capture)

    def score(self, batch: list[Sequence], slots: torch.Tensor, proposal: Proposal,
              chunks: list[tuple[int, list[int]]] = ()) -> Scored:
        """One pass over each row's unseen tokens plus its drafts, and the prompt `chunks` (cache slot, tokens)
        as rows of their own. A draft tree's pass has its own layout: no chunks ride it."""
        n_draft = proposal.n_draft.tolist()
        drafts = proposal.tokens.tolist()
        rows = [s.tokens[s.num_cached:] + d[:n] for s, d, n in zip(batch, drafts, n_draft)]
        tails = [len(s.tokens) - s.num_cached - 1 for s in batch]  # a prompt's last chunk, on its first step
        width = max(len(r) - t for r, t in zip(rows, tails))
        positions = sum(len(r) - t for r, t in zip(rows, tails))
        if chunks:
            rows += [tokens for _, tokens in chunks]
            slots = torch.cat((slots, torch.tensor([slot for slot, _ in chunks], device=self.device)))
        tokens, n_new = pad_rows(rows, self.device)
        parents = None if proposal.parents is None else self.tree_parents(rows, proposal, tokens.shape[1])
        hidden, read = self.forward(tokens, self.cache, slots, n_new, parents)  # [B + chunks, T, D]
        chunk_hidden = read[len(batch):] if chunks else None
        hidden, read, rows = hidden[:len(batch)], read[:len(batch)], rows[:len(batch)]
        return Scored(read, self.model.head(self.scored_positions(hidden, rows, n_draft, proposal)),
                      chunk_hidden, width, positions, sum(tails) + sum(len(t) for _, t in chunks))

    @staticmethod
    def tree_parents(rows: list[list[int]], proposal: Proposal, T: int) -> list[list[int]]:
        """Each fed token's parent among the row's: the unseen tokens are a chain; draft j hangs below the
        last of them or below its parent draft."""
        parents = []
        for row, tree, n in zip(rows, proposal.parents, proposal.n_draft.tolist()):
            unseen = len(row) - n
            fed = chain_padded([], unseen) + [unseen - 1 if p < 0 else unseen + p for p in tree[:n]]
            parents.append(chain_padded(fed, T))
        return parents

    def scored_positions(self, hidden: torch.Tensor, rows: list[list[int]], n_draft: list[int],
                         proposal: Proposal) -> torch.Tensor:
        """The hidden states [B, k+1, D] the logits are read at: row b's last unseen token predicts its first
        draft, so positions n_unseen-1 .. n_new-1 (all of a row that fed one unseen token and k drafts:
        decoding's usual pass). In the lm_head's dtype: greedy verification reads bf16 logits as they are."""
        k = proposal.tokens.shape[1]
        if all(n == k and len(row) == k + 1 for row, n in zip(rows, n_draft)):
            return hidden
        at = [[min(len(row) - n - 1 + j, len(row) - 1) for j in range(k + 1)] for row, n in zip(rows, n_draft)]
        index = torch.tensor(at, device=self.device)[..., None].expand(-1, -1, hidden.shape[-1])
        return hidden.gather(1, index)

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Feed prompt tokens into cache row `slot` in a pass of their own → their hidden states [1, n, D] (the
        captured layers' where a proposer reads them). A
        chunk computes each position as any other pass would (prepare_pass), so a prompt's keys do not depend
        on how it was cut, nor on which requests arrived with it."""
        if not tokens:
            width = self.model.cfg.dim * (len(self.capture) if self.capture else 1)
            return torch.zeros(1, 0, width, device=self.device, dtype=self.model.dtype)
        ids, n_new = pad_rows([tokens], self.device)
        return self.forward(ids, self.cache, torch.tensor([slot], device=self.device), n_new)[1]

    def prompt_pass(self, slot: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """prefill's pass → (the final hidden states [1, n, D], which the logits are read from; what the
        proposer reads)."""
        ids, n_new = pad_rows([tokens], self.device)
        return self.forward(ids, self.cache, torch.tensor([slot], device=self.device), n_new)

    def keep_branches(self, batch: list[Sequence], accepted: list[list[int]], hidden: torch.Tensor) -> torch.Tensor:
        """After a draft tree's verification: move the accepted branch's keys and values where the sequence
        continues (the other candidates sat between them) → the pass's hidden states [B, T, D] reordered alike,
        so a proposer reads the branch's features in sequence order."""
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
