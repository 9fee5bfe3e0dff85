"""Deliberately broken verifiers and proposers. The distribution tests must FAIL with each one:
that is what shows they have teeth. Each mutant replaces one seam of the real code."""

from __future__ import annotations

from dataclasses import replace

import torch

import speculant.verify as verify_module
from speculant.proposers.cross_vocab import CrossVocabProposer
from speculant.proposers.draft_model import DraftModelProposer
from speculant.sampling import DRAFT, probabilities, sample


class GreedyDraftSoftmaxQ(DraftModelProposer):
    """Drafts the argmax but reports the softmax as q."""

    def draw(self, logits, sb, vocab=None):
        q = probabilities(logits, sb)[:, 0]
        return q.argmax(dim=-1), q


class TransformsOnTargetOnly(DraftModelProposer):
    """Samples under the request's transforms but reports q from the raw logits."""

    def draw(self, logits, sb, vocab=None):
        token = sample(probabilities(logits, sb)[:, 0], sb.draws(DRAFT))
        return token, torch.softmax(logits[:, 0].float(), dim=-1)


def _unnormalized_residual(p, q):
    return (p - q).clamp_min(0.0)


def inverse_cdf_sample(probs, draws):
    """Exact for a normalized distribution; trusts its input to sum to 1 (as many samplers do)."""
    out = probs.argmax(dim=-1)
    for row, u in enumerate(draws):
        if u is not None:
            at = torch.searchsorted(probs[row].cumsum(0), torch.tensor([u], dtype=probs.dtype))
            out[row] = at.clamp(max=probs.shape[-1] - 1)[0]
    return out


class GrammarOnTargetOnly(DraftModelProposer):
    """Samples its drafts under the grammar but reports q from the logits without it: the grammar masks
    the target's p alone."""

    def draw(self, logits, sb, vocab=None):
        token, _ = super().draw(logits, sb, vocab)
        return token, probabilities(logits, sb)[:, 0]


def patch_grammar(name: str, monkeypatch) -> None:
    """Break the target's grammar masks (grammar_steps.constrain_logits, GrammarState.masks_along)."""
    from speculant.structured.grammar import GrammarState

    if name == "mask_at_committed_state":  # every draft position masked as if no draft came before it
        monkeypatch.setattr(GrammarState, "masks_along",
                            lambda self, tokens, parents=None: [self.bitmask()] * (len(tokens) + 1))
    else:
        raise ValueError(name)


PROPOSER_MUTANTS = {"greedy_draft_softmax_q": GreedyDraftSoftmaxQ,
                    "transforms_on_target_only": TransformsOnTargetOnly}


def patch_verifier(name: str, monkeypatch) -> None:
    if name == "residual_not_renormalized":
        monkeypatch.setattr(verify_module, "residual", _unnormalized_residual)
        monkeypatch.setattr(verify_module, "sample", inverse_cdf_sample)
    elif name == "acceptance_ignores_q":  # min(1, p(d)) while the residual still subtracts q
        monkeypatch.setattr(verify_module, "acceptance_probability", lambda p_d, q_d: p_d)
    else:
        raise ValueError(name)


VERIFIER_MUTANTS = ["residual_not_renormalized", "acceptance_ignores_q"]


def patch_mixed_rows(name: str, monkeypatch) -> None:
    """Break the per-row choice of verification in a step that mixes deterministic and model drafts."""
    import speculant.drafting as drafting_module
    import speculant.proposers.base as base_module
    import speculant.proposers.lookup_first as lookup_first_module

    if name == "every_row_by_the_rule":  # once a row carries q, every row goes through the rule (one-hot q)
        real = base_module.merged

        def merged(a, b):
            out = real(a, b)
            if out.q is None:
                return out
            deterministic = torch.tensor([not r for r in out.rule_list()])[:, None, None]
            one_hot = torch.nn.functional.one_hot(out.tokens, out.q.shape[-1]).to(out.q.dtype)
            return replace(out, q=torch.where(deterministic, one_hot, out.q), by_rule=None)

        monkeypatch.setattr(lookup_first_module, "merged", merged)
        monkeypatch.setattr(drafting_module, "merged", merged)
    else:
        raise ValueError(name)


def patch_seeded_rows(name: str, monkeypatch) -> None:
    """Break what makes a seeded draft-model row write plain decoding's tokens (Proposer.draw, verify.rule_rows)."""
    from speculant.sampling import SamplingBatch

    if name == "seeded_by_the_rule":  # a seeded row's drafts drawn from q and verified by the rule, as unseeded
        monkeypatch.setattr(SamplingBatch, "is_seeded", lambda self, b: False)
    elif name == "coupled_draw_by_the_rule":  # drawn as plain decoding draws, but verified by the rule
        real = verify_module.rule_rows
        monkeypatch.setattr(verify_module, "rule_rows",
                            lambda q, by_rule, n_draft, sb: real(q, by_rule, n_draft, replace(sb, seeded=None)))
    else:
        raise ValueError(name)


def patch_coupling(name: str, monkeypatch) -> None:
    """Break verification by coupling (deterministic drafts: verify.TargetTokens, follow_chain, follow_tree)."""
    if name == "one_draw_for_every_position":  # a step's positions share the first one's uniform
        at = verify_module.TargetTokens.at
        monkeypatch.setattr(verify_module.TargetTokens, "at", lambda self, b, column, offset: at(self, b, column, 0))
    elif name == "rejected_position_drawn_again":  # a mismatch draws the token anew: the draft may come back
        def chain(drafts, target):
            for j, d in enumerate(drafts):
                if target(j, j) != d:
                    return j, target(j, j + 1000)
            return len(drafts), target(len(drafts), len(drafts))

        monkeypatch.setattr(verify_module, "follow_chain", chain)
    elif name == "each_candidate_its_own_draw":  # a tree node's candidates tested against separate draws
        def tree(tokens, parents, n, target):
            path, node = [], -1
            while True:
                children = [j for j in range(n) if parents[j] == node]
                kept = next((j for i, j in enumerate(children) if target(node + 1, len(path) + 1000 * i) == tokens[j]),
                            None)
                if kept is None:
                    return path, target(node + 1, len(path))
                path.append(kept)
                node = kept

        monkeypatch.setattr(verify_module, "follow_tree", tree)
    else:
        raise ValueError(name)


class ReducedVocabFullQ(DraftModelProposer):
    """Draws from the reduced vocabulary's distribution but reports the whole vocabulary's as q."""

    def draw(self, logits, sb, vocab=None):
        token, _ = super().draw(logits, sb, vocab)
        head, self.head = self.head, None
        q = probabilities(self._logits(self._last_hidden), sb)[:, 0]
        self.head = head
        return token, q

    def _logits(self, hidden):
        self._last_hidden = hidden
        return super()._logits(hidden)


class StopsOnTheDrawnToken(DraftModelProposer):
    """Decides p_min on the token it drew: a later draft is kept only where q gave it at least p_min."""

    def stop_unsure(self, confidence, n_draft, i):
        return n_draft

    def end_chain(self, chain, n_draft, i):
        return n_draft

    def unsure(self, logits, token, q):
        """Per row, whether the token just drawn at a later position cuts the draft there."""
        return q.gather(-1, token[:, None]).squeeze(-1) < self.p_min

    def draw(self, logits, sb, vocab=None):
        token, q = super().draw(logits, sb, vocab)
        i, self._position = self._position, self._position + 1
        unsure = self.unsure(logits, token, q)
        if i:
            self._n_draft = [n if not u else min(n, i) for n, u in zip(self._n_draft, unsure.tolist())]
        return token, q

    def propose(self, seqs, ks, sb):
        if not all(ks):  # the rows with drafts to make come back here on their own
            return DraftModelProposer.propose(self, seqs, ks, sb)
        self._n_draft, self._position = list(ks), 0
        proposal = super().propose(seqs, ks, sb)
        # The kept drafts are those before the first unlikely one drawn.
        proposal.n_draft = torch.minimum(proposal.n_draft, torch.tensor(self._n_draft))
        return proposal


class ChainOnTheDrawnToken(StopsOnTheDrawnToken):
    """Decides p_chain on the tokens drawn up to and including position i: a later draft is kept only while the
    draft's probability of every token drawn so far, its own included, stays at least p_chain."""

    def propose(self, seqs, ks, sb):
        self._chain = torch.ones(len(seqs))
        return super().propose(seqs, ks, sb)

    def unsure(self, logits, token, q):
        self._chain = self._chain * torch.softmax(logits[:, 0], dim=-1).gather(-1, token[:, None]).squeeze(-1)
        return self._chain < self.p_chain


# name → (proposer class, its rule settings)
DRAFT_RULE_MUTANTS = {"reduced_vocab_full_q": (ReducedVocabFullQ, {"vocab_size": 5}),
                      "p_min_on_the_drawn_token": (StopsOnTheDrawnToken, {"p_min": 0.45}),
                      "p_chain_on_the_drawn_token": (ChainOnTheDrawnToken, {"p_chain": 0.2})}


def patch_rule_error(name: str, size: float, monkeypatch) -> None:
    """The rule off by `size`: acceptance probabilities scaled by 1 − size, or the residual mixed with size·p."""
    if name == "acceptance_scaled":
        exact = verify_module.acceptance_probability
        monkeypatch.setattr(verify_module, "acceptance_probability", lambda p_d, q_d: (1 - size) * exact(p_d, q_d))
    elif name == "residual_mixed_with_p":
        exact_residual = verify_module.residual
        monkeypatch.setattr(verify_module, "residual", lambda p, q: (1 - size) * exact_residual(p, q) + size * p)
    else:
        raise ValueError(name)


def patch_routing(name: str, monkeypatch) -> None:
    """Break the routing rule of a mixture-of-experts layer (models/moe.py, MoE.route)."""
    from speculant.models import moe

    if name == "softmax_after_topk":  # every family routed as Mixtral: Qwen3-MoE without norm_topk_prob differs
        def route(self, x):
            top, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
            return torch.softmax(top.float(), dim=-1).to(x.dtype), chosen
    elif name == "weights_not_renormalised":  # softmax over every expert, the top k's weights used as they are
        def route(self, x):
            weights, chosen = torch.topk(torch.softmax(self.gate(x).float(), dim=-1), self.top_k, dim=-1)
            return weights.to(x.dtype), chosen
    else:
        raise ValueError(name)
    monkeypatch.setattr(moe.MoE, "route", route)


# mutant → the family whose exactness test must catch it
ROUTING_MUTANTS = {"softmax_after_topk": "qwen3_moe", "weights_not_renormalised": "mixtral"}


def flip_verified_token(monkeypatch, position: int) -> None:
    """A verifier that gets one token wrong: in each speculating row, the token it verifies at output `position`
    (an accepted draft or the token after them) becomes the next token id, and the drafts accepted after it are
    dropped. The output then differs from plain decoding from `position` on; rows decoded without speculation
    (the audit's) are left alone."""
    from speculant.engine import Engine

    real = Engine.verify

    def verify(self, proposal, logits, sb):
        accepted, next_tokens = real(self, proposal, logits, sb)
        drafts = proposal.tokens.tolist()
        for b, seq in enumerate(self._batch):
            j = position - seq.num_generated
            if not seq.speculate or not 0 <= j <= len(accepted[b]):
                continue
            token = drafts[b][accepted[b][j]] if j < len(accepted[b]) else next_tokens[b]
            accepted[b] = list(accepted[b][:j])
            next_tokens[b] = (token + 1) % self.model.cfg.vocab_size
        return accepted, next_tokens

    monkeypatch.setattr(Engine, "verify", verify)


def patch_state_rollback(name: str, monkeypatch) -> None:
    """Break a hybrid model's rollback of its recurrent states (models/state_cache.py, HybridCache.set_lengths)."""
    from speculant.models.state_cache import HybridCache

    real_set, real_keep = HybridCache.set_lengths, HybridCache.positions_to_keep

    def held_before(cache, slot, length):
        return max((n for n in cache.state_lengths(slot) if n < length), default=None)

    if name == "state_one_position_off":  # the state of the position before the one kept
        def set_lengths(self, slots, lengths):
            for slot, length in zip(slots, lengths):
                if self.has_state(slot, length - 1) and length - 1 > 0 and self.has_state(slot, length):
                    self.states[slot][length] = list(self.states[slot][length - 1])
            real_set(self, slots, lengths)
    elif name == "conv_window_forgotten":  # the matrix rolled back, the conv window left at the newest position
        def set_lengths(self, slots, lengths):
            for slot, length in zip(slots, lengths):
                newest = max(self.state_lengths(slot), default=length)
                if newest != length and self.has_state(slot, length) and length:
                    self.states[slot][length] = [(m, self.states[slot][newest][j][1])
                                                 for j, (m, _) in enumerate(self.states[slot][length])]
            real_set(self, slots, lengths)
    elif name == "stale_state_after_no_drafts":  # vLLM #52942: a step without drafts after one with drafts keeps
        # no state of its own, and the row goes on from the last one it had
        widths: dict[int, int] = {}

        def positions_to_keep(self, slots, starts, n_real, T):
            keep = real_keep(self, slots, starts, n_real, T)
            stale = [row for row, slot in enumerate(slots) if T == 1 and widths.get(slot, 1) > 1]
            for slot in slots:
                widths[slot] = T
            return [[row for row in rows if row not in stale] for rows in keep]

        def set_lengths(self, slots, lengths):
            for slot, length in zip(slots, lengths):
                if not self.has_state(slot, length) and (before := held_before(self, slot, length)) is not None:
                    self.states[slot][length] = list(self.states[slot][before])
            real_set(self, slots, lengths)

        monkeypatch.setattr(HybridCache, "positions_to_keep", positions_to_keep)
    else:
        raise ValueError(name)
    monkeypatch.setattr(HybridCache, "set_lengths", set_lengths)


STATE_MUTANTS = ["state_one_position_off", "conv_window_forgotten", "stale_state_after_no_drafts"]


class TLINotRenormalised(CrossVocabProposer):
    """Draws from the draft's distribution over the shared tokens, renormalised, but reports q as the draft's
    whole-vocabulary probabilities of those tokens (summing to less than 1)."""

    def draw(self, logits, sb, vocab=None):
        token, _ = super().draw(logits, sb, vocab)
        whole = probabilities(self.model.logits(self._hidden).float(), sb)[:, 0]
        q = whole.new_zeros(whole.shape[0], self.vocab_size).index_copy_(1, vocab, whole[:, self.map_draft])
        return token, q

    def _tli_logits(self, hidden, full):
        self._hidden = hidden
        return super()._tli_logits(hidden, full)


class TLIOneIdWrong(CrossVocabProposer):
    """Maps its drafts right, but writes q with one shared token (the likeliest in the first row) at a target id
    the draft cannot propose."""

    def draw(self, logits, sb, vocab=None):
        token, q = super().draw(logits, sb, vocab)
        spare = next(i for i in range(self.vocab_size) if i not in set(vocab.tolist()))
        wrong = vocab.clone()
        wrong[int(q[0, vocab].argmax())] = spare
        return token, torch.zeros_like(q).index_copy_(1, wrong, q[:, vocab])


CROSS_VOCAB_MUTANTS = {"tli_not_renormalised": TLINotRenormalised, "tli_one_id_wrong": TLIOneIdWrong}
