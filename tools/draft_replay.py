"""How far could better choices take prompt lookup and the corpus table? Replays the bundled model's greedy
answers to the bench prompts offline: at each step the default's drafts (lookup up to 6 tokens, the
corpus table where it matches fewer than 2) are compared with what the model wrote next, and a step's
cost is its pass width's C(w)/C(1). Prints tokens per step and speed-up per prompt class for fixed k, for
an oracle that verifies exactly the drafts that will be accepted, and for the best continuation of every
earlier match (not only the latest one's) at k = 6. No engine overhead is counted.

    python tools/draft_replay.py [--costs 1.08,1.13,1.20,1.30,1.42,1.63] [--per-class 6] [--max-tokens 128]

--costs: C(w)/C(1) for w = 2 … 7 as the decoding loop pays them (the default: docs/history.md,
timed steps of each width in the loop; an isolated pass costs less).
"""

import argparse

import torch

from speculant.bench.prompts import load_prompts
from speculant.config import SamplingParams
from speculant.defaults import CORPUS
from speculant.llm import engine_for
from speculant.models.loader import load_model
from speculant.proposers.corpus import load_corpus
from speculant.proposers.ngram import NgramProposer, SuffixIndex, continuation

K = 6


def kept(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(drafts), len(truth)) and drafts[n] == truth[n]:
        n += 1
    return n


def every_continuation(tokens: list[int], k: int) -> list[list[int]]:
    """The k tokens after every earlier occurrence of every suffix of 1 to 6 tokens."""
    L, found = len(tokens), []
    for n in range(1, min(K, L - 1) + 1):
        suffix = tokens[L - n:]
        found += [continuation(tokens, end, k) for end in range(n - 1, L - 1) if tokens[end - n + 1:end + 1] == suffix]
    return found


def replay(answers: list[tuple[str, list[int], list[int]]], proposer: NgramProposer, cost: list[float],
           policy: str) -> dict[str, tuple[float, float]]:
    """Per class: (tokens per step, tokens per unit of C(1))."""
    totals: dict[str, list[float]] = {}
    for cls, prompt, answer in answers:
        text = prompt + answer[:1]
        index = SuffixIndex(text, K)
        tokens = steps = paid = 0.0
        while len(text) < len(prompt) + len(answer):
            truth = answer[len(text) - len(prompt):]
            drafts, _ = proposer._draft(index, K)
            if policy == "oracle":
                accepted = kept(drafts, truth)
                width = accepted
            elif policy == "every":
                accepted = max([kept(d, truth) for d in every_continuation(text, K)] + [kept(drafts, truth)])
                width = len(drafts)
            else:
                drafts = drafts[:int(policy)]
                accepted, width = kept(drafts, truth), len(drafts)
            accepted = min(accepted, len(truth) - 1)
            text.extend(truth[:accepted + 1])
            tokens, steps, paid = tokens + accepted + 1, steps + 1, paid + cost[width]
        for key in (cls, "all"):
            t = totals.setdefault(key, [0.0, 0.0, 0.0])
            t[0], t[1], t[2] = t[0] + tokens, t[1] + steps, t[2] + paid
    return {key: (t[0] / t[1], t[0] / t[2]) for key, t in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--costs", default="1.08,1.13,1.20,1.30,1.42,1.63")
    parser.add_argument("--per-class", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    cost = [1.0, *map(float, args.costs.split(","))]  # index: drafts in the pass (width − 1)
    target = load_model(None, dtype="auto", quantization="auto")
    prompts = load_prompts(["code", "chat", "rewrite"], target.tokenizer, target.config.vocab_size,
                           per_class=args.per_class)
    engine = engine_for(target, None, 1, 2048)
    answers = []
    with torch.inference_mode():
        for p in prompts:
            seq = engine.generate([engine.add_request(p.token_ids, SamplingParams(max_tokens=args.max_tokens,
                                                                                  temperature=0))])[0]
            answers.append((p.prompt_class, list(p.token_ids), seq.output_ids))
    proposer = NgramProposer(1, K, load_corpus(CORPUS, target))
    for policy in ("1", "2", "3", "4", "6", "oracle", "every"):
        name = {"oracle": "oracle width", "every": "every match, k=6"}.get(policy, f"k={policy}")
        result = replay(answers, proposer, cost, policy)
        print(f"{name:>17}: " + ", ".join(f"{key} {tps:.2f} tok/step {speedup:.2f}x"
                                          for key, (tps, speedup) in result.items()))


if __name__ == "__main__":
    main()
