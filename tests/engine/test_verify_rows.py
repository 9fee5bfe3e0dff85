"""Each row of a step is verified its own way, whatever shares the step: drafts drawn from q with draws of their
own by the acceptance rule, every other row (lookup, a grammar's forced tokens, greedy) by coupling, so a seeded
row of deterministic drafts writes plain decoding's tokens in any batch."""

from __future__ import annotations

import torch

from speculant.config import SamplingParams
from speculant.proposers.base import Proposal, merged
from speculant.sampling import SamplingBatch, request_key
from speculant.verify import TargetTokens, verify_logits

V, K = 16, 3


def batch(rows: list[SamplingParams]) -> SamplingBatch:
    keys = [None if p.greedy else request_key(p.seed) for p in rows]
    return SamplingBatch.build(rows, keys, torch.device("cpu"), positions=[5 * b for b in range(len(rows))])


def plain_tokens(logits: torch.Tensor, sb: SamplingBatch, b: int) -> list[int]:
    """Row b's tokens as plain decoding draws them at its K + 1 positions, where every draft before is kept."""
    tokens = TargetTokens(logits, sb)
    return [tokens.at(b, j, j) for j in range(K + 1)]


def test_deterministic_rows_are_coupled_beside_rows_verified_by_the_rule():
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingParams(temperature=0.8, top_p=0.9, seed=b) for b in range(6)] + [SamplingParams(temperature=0)]
    sb = batch(rows)
    logits = torch.randn(len(rows), K + 1, V, generator=gen) * 2
    expected = [plain_tokens(logits, sb, b) for b in range(len(rows))]
    # Rows 0-2 drew from q (row 2 drew nothing): the rule; 3-6 are deterministic: the plain tokens up to a wrong
    # one at row b - 3.
    drafts = torch.randint(0, V, (len(rows), K), generator=gen)
    for b in range(3, len(rows)):
        drafts[b] = torch.tensor(expected[b][:K])
        if b - 3 < K:
            drafts[b, b - 3] = (expected[b][b - 3] + 1) % V
    q = torch.softmax(torch.randn(len(rows), K, V, generator=gen), dim=-1)
    by_rule = [True] * 3 + [False] * 4
    n_draft = torch.tensor([K, K, 0, K, K, K, K])
    accepted, tokens = verify_logits(drafts, n_draft, logits, q, sb, by_rule)
    assert (accepted[2], tokens[2]) == (0, expected[2][0])  # no draft: plain decoding's token
    for b in range(3, len(rows)):
        kept = min(b - 3, K)
        assert accepted[b] == kept and tokens[b] == expected[b][kept]
        alone = verify_logits(drafts[b:b + 1], n_draft[b:b + 1], logits[b:b + 1], None,
                              SamplingBatch.build([rows[b]], [sb.keys[b]], torch.device("cpu"), [sb.positions[b]]))
        assert alone == ([accepted[b]], [tokens[b]])


def test_merged_rows_keep_their_own_verification():
    """Lookup drafts (q None) merged with a model's (q in rows 1 and 2, row 2 a greedy row's): the rule reads
    row 1 alone; rows without model drafts keep the lookup's."""
    lookup = Proposal.from_lists([[4, 5], [], [], [7]], torch.device("cpu"))
    q = torch.softmax(torch.randn(4, 2, V), dim=-1)
    model = Proposal(torch.tensor([[0, 0], [1, 2], [3, 3], [0, 0]]), torch.tensor([0, 2, 2, 0]), q,
                     by_rule=[False, True, False, False])
    out = merged(lookup, model)
    assert out.tokens.tolist() == [[4, 5], [1, 2], [3, 3], [7, 0]]
    assert out.by_rule == [False, True, False, False]
    assert torch.equal(out.q[1], q[1])
    assert merged(lookup, Proposal.from_lists([[], [], [], []], torch.device("cpu"))).q is None
