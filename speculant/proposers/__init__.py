"""Proposers guess the next k tokens; the verifier decides. One interface for all of them."""

from __future__ import annotations

from dataclasses import replace

from speculant.config import SpeculativeConfig
from speculant.errors import SpeculantError
from speculant.models.loader import LoadedModel, load_model
from speculant.proposers.base import Proposal, Proposer, TargetHidden

__all__ = ["Proposal", "Proposer", "TargetHidden", "build_proposer"]


def build_proposer(cfg: SpeculativeConfig, target: LoadedModel, max_batch_size: int, max_len: int) -> Proposer:
    check_chains(cfg, target)
    if cfg.lookup_first:
        from speculant.proposers.lookup_first import LookupFirstProposer

        alone = replace(cfg, lookup_first=False, corpus=None, history_tokens=0)
        model = build_proposer(alone, target, max_batch_size, max_len)
        return LookupFirstProposer(prompt_lookup(cfg, target), model)
    if cfg.method == "ngram":
        return prompt_lookup(cfg, target)
    if cfg.method == "draft_model":
        from speculant.proposers.draft_model import DraftModelProposer, check_vocab, warn_if_not_cheaper

        draft = load_model(cfg.model, dtype=target.model.dtype, device=target.model.device,
                           quantization=target.quantization, requantize_q4_0=cfg.draft_quantization == "q4_0")
        same_vocab = check_vocab(target, draft)
        check_chains(cfg, draft)
        warn_if_not_cheaper(target, draft)
        if not same_vocab:
            return build_cross_vocab(cfg, target, draft, max_batch_size, max_len)
        if cfg.tree_width > 1:
            from speculant.adaptive import cost_curve_for
            from speculant.proposers.draft_model_tree import DraftModelTreeProposer

            k = cfg.num_speculative_tokens
            # The curve adaptive k reads (llm.engine_for: the same file in the cache), measured now if it is not
            # cached: a sequence alone needs it at its first step, and a first step is timed.
            curve = cost_curve_for(target.model, max_batch_size, k + cfg.tree_width)
            return DraftModelTreeProposer(draft, target.config.vocab_size, max_batch_size, max_len,
                                          cfg.draft_vocab_size, cfg.draft_p_min, cfg.draft_p_chain, cfg.tree_width,
                                          k, lambda: curve)
        return DraftModelProposer(draft, target.config.vocab_size, max_batch_size, max_len, cfg.draft_vocab_size,
                                  cfg.draft_p_min, cfg.draft_p_chain)
    if cfg.method == "eagle":
        from speculant.proposers.eagle import EagleProposer, load_eagle

        return EagleProposer(load_eagle(cfg.model, target), target.model, max_batch_size, max_len, cfg.tree_width,
                             cfg.num_speculative_tokens)
    if cfg.method == "eagle3":
        from speculant.proposers.eagle3 import Eagle3Proposer, load_eagle3

        return Eagle3Proposer(load_eagle3(cfg.model, target), target.model, max_batch_size, max_len, cfg.tree_width,
                              cfg.num_speculative_tokens)
    if cfg.method == "mtp":
        from speculant.proposers.mtp import MTPProposer, load_mtp

        return MTPProposer(load_mtp(target, cfg.model), target.model, max_batch_size, max_len)
    raise NotImplementedError(f"method {cfg.method!r} is not available yet")


def build_cross_vocab(cfg: SpeculativeConfig, target: LoadedModel, draft: LoadedModel, max_batch_size: int,
                max_len: int) -> Proposer:
    """A draft of another tokenizer: TLI or string level, said in one line (a draft sharing almost nothing
    with the target is refused in that line)."""
    from speculant.models import notice
    from speculant.proposers.cross_vocab import CrossVocabProposer
    from speculant.proposers.vocab_map import vocab_map

    if cfg.tree_width > 1:
        raise SpeculantError(f"tree_width {cfg.tree_width}: a draft of another vocabulary drafts in chains "
                             "(tree_width 1)")
    vmap = vocab_map(target.tokenizer.hf, draft.tokenizer.hf, target.config.vocab_size, draft.config.vocab_size)
    if vmap.mapping() == "refuse":
        raise SpeculantError(vmap.describe())
    notice.log.info(vmap.describe())
    return CrossVocabProposer(draft, target, vmap, max_batch_size, max_len, vocab_size=cfg.draft_vocab_size,
                              p_min=cfg.draft_p_min, p_chain=cfg.draft_p_chain)


def check_chains(cfg: SpeculativeConfig, model: LoadedModel) -> None:
    if cfg.tree_width > 1 and model.config.linear_layers:
        raise SpeculantError(f"{model.source}: tree_width {cfg.tree_width}: a draft tree needs a recurrent state per "
                             "node and this hybrid model's Gated DeltaNet layers keep one per row; it drafts in "
                             "chains (tree_width 1)")


def prompt_lookup(cfg: SpeculativeConfig, target: LoadedModel) -> Proposer:
    from speculant.proposers.corpus import load_corpus
    from speculant.proposers.history import AnswerHistory
    from speculant.proposers.ngram import NgramProposer

    corpus = load_corpus(cfg.corpus, target) if cfg.corpus else None
    history = AnswerHistory(cfg.history_tokens) if cfg.history_tokens else None
    return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, corpus, history)
