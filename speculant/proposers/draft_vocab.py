"""A draft that scores part of the vocabulary (FR-Spec's idea): the tokens a byte-level BPE merged first, its
most frequent, and the added tokens (an answer's end, a template's markers).

The head is most of a small draft's pass (the 0.5B Qwen's is 136M of 494M parameters) and reading fewer of
its rows is what makes the draft cheaper. The draft draws from its distribution over these tokens and reports
exactly that as q, zero elsewhere, so the acceptance rule stays exact: the target's tokens the draft cannot
propose cost acceptance, never correctness.
"""

from __future__ import annotations

import torch
from torch import nn

from speculant.models.ggml import GGMLLinear
from speculant.models.kernels import PackedLinear

GGML_BLOCK = 16  # outputs per block of the ggml kernel's layout (models/ggml.py)


def draft_vocab_ids(size: int, vocab: int, added: list[int]) -> torch.Tensor:
    """The ids the draft scores: 0 .. size-1 and the added tokens, sorted, all below `vocab`."""
    ids = set(range(min(size, vocab))) | {i for i in added if 0 <= i < vocab}
    return torch.tensor(sorted(ids), dtype=torch.long)


class HeadRows(nn.Module):
    """The logits of a fixed set of tokens [..., n]: the head's rows for those ids alone, where its layout
    lets them be taken (a ggml head's blocks of 16, a dense weight's rows), else the whole head's logits
    indexed (exact, not cheaper). `ids` [n] may grow to the ggml blocks that hold them."""

    def __init__(self, head: nn.Module, ids: torch.Tensor):
        super().__init__()
        self.full: nn.Module | None = None
        if isinstance(head, GGMLLinear) and len(head.weights) == 7:
            blocks = torch.unique(ids // GGML_BLOCK)
            ids = (blocks[:, None] * GGML_BLOCK + torch.arange(GGML_BLOCK)).flatten()
            ids = ids[ids < head.out_features]  # the head's padding rows are in its last block, at the end
            weights = [w if w.numel() == 0 or i == 6 else w.index_select(0, blocks) for i, w in enumerate(head.weights)]
            self.rows = GGMLLinear([weights], head.in_features, out_features=len(ids))
        elif (weight := dense_weight(head)) is not None:
            linear = nn.Linear(weight.shape[1], len(ids), bias=False, dtype=weight.dtype, device=weight.device)
            linear.weight.data = weight.index_select(0, ids.to(weight.device)).contiguous()
            self.rows = PackedLinear(linear) if weight.device.type == "cpu" else linear
        else:
            self.rows, self.full = None, head
        self.register_buffer("ids", ids.to(head_device(head)), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.full is not None:
            return self.full(hidden).index_select(-1, self.ids)
        return self.rows(hidden)


def dense_weight(head: nn.Module) -> torch.Tensor | None:
    """The head's weight as [V, D] where it is stored plainly (a Linear, a transposed PackedLinear), else None."""
    if type(head) is nn.Linear:
        return head.weight.detach()
    if isinstance(head, PackedLinear) and head.kind == "transposed":
        return head.weight.t()
    return None


def head_device(head: nn.Module) -> torch.device:
    return next(iter(head.buffers()), next(iter(head.parameters()), torch.zeros(0))).device
