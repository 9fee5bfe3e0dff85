"""Acceptance of a draft model's drafts verified by the acceptance rule against drafts coupled with the
target's draws (docs/lossless.md, "Seeded"): the bundled SmolLM2 GGUF with its distilled draft (made by train-draft) (or
its own file requantized to Q4_0, a draft close to it), fixed k, a few chat and code prompts. Counts only
(accepted / drafted, tokens a target pass), no timings.

    python tools/coupled_drafts.py --temperatures 0.7 1.0 --tokens 96 --seeds 2 [--p-chain 0.7] [--draft q4_0]

Besides the engine's counts it reports, at the positions of the rule's runs, the exact per-position chance
each way: Σ min(p, q) for the rule, the overlap of p's and q's intervals in the sampler's order for coupling.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from speculant import sampling
from speculant.bench.suite import MADE_DRAFTS_DIR
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.models.loader import default_model_path, load_model
from speculant.proposers import build_proposer

DISTILLED = MADE_DRAFTS_DIR / "smollm2-135m-instruct" / "draft_model"
PROMPTS = Path(sampling.__file__).parent / "data" / "prompts"


def prompts(target, n: int) -> list[list[int]]:
    rows = []
    for name in ("chat", "code"):
        lines = (PROMPTS / f"{name}.jsonl").read_text().splitlines()[:n]
        rows += [target.tokenizer.encode_chat([{"role": "user", "content": json.loads(line)["prompt"]}])
                 for line in lines]
    return rows


def run(target, verified: str, k: int, params: list[SamplingParams], rows: list[list[int]],
        p_chain: float, draft: str) -> tuple[Engine, list]:
    spec = {"method": "draft_model", "model": str(DISTILLED), "num_speculative_tokens": k,
            "draft_p_chain": p_chain}
    if draft == "q4_0":  # the target's own file with its wider matrices as Q4_0: a draft close to the target
        spec |= {"model": str(default_model_path()), "draft_quantization": "q4_0"}
    cfg = SpeculativeConfig.parse(spec)
    proposer = build_proposer(cfg, target, len(rows), 512 + k + 1)
    engine = Engine(target, proposer, k, max_batch_size=len(rows), max_model_len=512)
    if verified == "coupling":  # the engine couples a seeded row's drafts itself (Proposer.draw)
        return engine, engine.generate([engine.add_request(r, p) for r, p in zip(rows, params)])
    # The rule's arm judges these seeded rows as unseeded ones.
    seeded = sampling.SamplingBatch.is_seeded
    sampling.SamplingBatch.is_seeded = lambda self, b: False
    try:
        return engine, engine.generate([engine.add_request(r, p) for r, p in zip(rows, params)])
    finally:
        sampling.SamplingBatch.is_seeded = seeded


def exact_chances(target, engine: Engine, seqs: list, temperature: float) -> dict:
    """Over every output position of the sequences (their prefixes are the target's draws): the
    mean chance that a draft there is kept, by the rule (Σ min(p, q)) and by coupling (the overlap of p's
    and q's intervals in the vocabulary's order, the sampler's order without top-k or top-p; and, for
    comparison, in each distribution's descending order, where a sampler laid the likeliest tokens first)."""
    proposer = engine.proposer
    sb = sampling.SamplingBatch.build([SamplingParams(temperature=temperature)], [None], target.model.device)
    rule, coupled, sorted_order, n = 0.0, 0.0, 0.0, 0
    for seq in seqs:
        ids = torch.tensor([seq.tokens[:-1]])
        cache = target.model.new_cache(1, ids.shape[1])
        p_logits = target.model.logits(target.model(ids, cache, torch.tensor([0])))
        cache = proposer.model.new_cache(1, ids.shape[1])
        q_logits = proposer._logits(proposer.model(ids, cache, torch.tensor([0])))
        start = len(seq.prompt_ids) - 1
        p = sampling.probabilities(p_logits[:, start:].float(), sb)[0].double()
        q = sampling.probabilities(q_logits[:, start:].float(), sb)[0].double()
        rule += float(torch.minimum(p, q).sum())
        fp, fq = p.cumsum(-1), q.cumsum(-1)
        low = torch.maximum(fp - p, fq - q)
        coupled += float((torch.minimum(fp, fq) - low).clamp_min(0).sum())
        sp, sq = before_in_descending_order(p), before_in_descending_order(q)
        sorted_order += float((torch.minimum(sp + p, sq + q) - torch.maximum(sp, sq)).clamp_min(0).sum())
        n += p.shape[0]
    return {"exact_rule": round(rule / n, 4), "exact_coupled": round(coupled / n, 4),
            "exact_coupled_descending": round(sorted_order / n, 4), "positions": n}


def before_in_descending_order(p: torch.Tensor) -> torch.Tensor:
    """[T, V]: the mass before each token where a sampler lays a row's tokens out likeliest first."""
    values, order = p.sort(dim=-1, descending=True, stable=True)
    return torch.empty_like(p).scatter_(-1, order, values.cumsum(-1) - values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="of each kind (chat, code)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft", choices=["distilled", "q4_0"], default="distilled",
                        help="the distilled draft (made by train-draft), or the target's own file requantized to Q4_0")
    parser.add_argument("--p-chain", type=float, default=0.0, help="draft_p_chain (the default draft's: 0.7)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model(default_model_path(), dtype="auto", quantization="auto")
    rows = prompts(target, args.prompts)
    for temperature in args.temperatures:
        for verified in ("rule", "coupling"):
            engine_rows, params = [], []
            for seed in range(args.seeds):
                engine_rows += rows
                params += [SamplingParams(temperature=temperature, seed=seed * 100 + i, max_tokens=args.tokens,
                                          ignore_eos=True) for i in range(len(rows))]
            engine, seqs = run(target, verified, args.k, params, engine_rows, args.p_chain, args.draft)
            s = engine.stats
            result = {"draft": args.draft, "temperature": temperature, "p_chain": args.p_chain,
                      "verified": verified,
                      "drafted": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
                      "acceptance": round(s.num_accepted_tokens / max(s.num_draft_tokens, 1), 4),
                      "per_position": [round(a / max(d, 1), 3) for a, d in zip(s.accepted_per_pos, s.drafts_per_pos)],
                      "tokens_per_pass": round(engine.timing.tokens / max(s.target_passes, 1), 3)}
            if verified == "rule":
                result |= exact_chances(target, engine, seqs, temperature)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
