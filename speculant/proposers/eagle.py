"""EAGLE-style head (Li et al., 2024): one decoder layer that drafts from the target's features.

The head reads (the target's last hidden state at position t, the embedding of token t+1) and
predicts the hidden state at t+1; the target's own frozen lm_head turns it into next-token
logits. Drafting runs the head on its own predictions. The features here are the target's final
hidden states *after* its final norm (what lm_head reads), not the pre-norm ones of the paper:
the head ends with its own RMSNorm so its output lives in the same space.

A head may carry a draft vocabulary: the ids of the tokens it drafts from (the target's most frequent
next tokens in its training data). Its logits are then the lm_head rows of those tokens only: the
full head is most of a draft token's cost on a small target, and drafts outside the vocabulary are
rare guesses anyway. The verifier still scores every token with the
full head, so the output stays the target's.

A head is saved as eagle.safetensors + eagle_config.json, which names the target it was trained
for; loading it for another target is refused.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from speculant.errors import SpeculantError
from speculant.models.attention import prepare_pass
from speculant.models.kernels import pack_linears
from speculant.models.kv_cache import KVCache
from speculant.models.llama import Block, RMSNorm, Transformer
from speculant.models.loader import LoadedModel
from speculant.models.model_config import ModelConfig
from speculant.models.rope import Rope, rope_inv_freq
from speculant.proposers.base import Proposal, Proposer, TargetHidden, chain_padded, pad_rows
from speculant.proposers.draft_tree import DraftTree, branch_pass
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence

WEIGHTS = "eagle.safetensors"
CONFIG = "eagle_config.json"
PROBE_ROWS, PROBE_DIMS = 32, 16
MIN_PROBE_COSINE = 0.9  # the same weights, even 4-bit quantized, stay above 0.98; another model is near 0


class EagleHead(nn.Module):
    """fc([embedding of token t+1, feature t]) → one Llama decoder layer → RMSNorm → feature t+1."""

    def __init__(self, cfg: ModelConfig, vocab: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("vocab", vocab)  # [N] draft vocabulary ids, or None: the whole vocabulary
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.layer = Block(cfg, 0)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope = Rope()

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c, w = self.cfg, self.fc.weight
        return KVCache(1, max_batch, c.n_kv_heads, max_len, c.head_dim, w.dtype, w.device)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                n_new: torch.Tensor | None = None, parents: list[list[int]] | None = None) -> torch.Tensor:
        """embeds, features [B, T, D] → predicted next features [B, T, D]; appends to the cache
        rows `slots` like Transformer.forward (only the first n_new[b] inputs of row b are real;
        `parents`: they are a draft tree, see prepare_pass)."""
        dtype = self.fc.weight.dtype
        fwd = prepare_pass(cache, slots, embeds.shape[1], n_new, self.rope, self.inv_freq, dtype, parents=parents)
        x = self.fc(torch.cat((embeds, features), dim=-1).to(dtype))
        if fwd.n_keys is not None and self.layer.native_weights is not None:
            x = self.layer.forward_native(x, cache, fwd)
        else:
            x = self.layer(x, cache, fwd)
        cache.lengths[slots] = fwd.end
        return self.norm(x)


def draft_lm_head(target: Transformer, vocab: torch.Tensor | None) -> nn.Module:
    """The target's lm_head restricted to the rows of `vocab` (whole when None). Its rows are read
    back through the head itself (x = identity: one exact product per weight), whatever layout
    or quantization the target's lm_head has."""
    if vocab is None:
        return target.lm_head
    eye = torch.eye(target.cfg.dim, dtype=target.dtype, device=target.device)
    rows = target.lm_head(eye)[:, vocab].t().contiguous()  # [N, D]
    head = nn.Linear(target.cfg.dim, len(vocab), bias=False, device=target.device, dtype=target.dtype)
    head.weight.data.copy_(rows)
    return pack_linears(nn.Sequential(head))[0].requires_grad_(False)


def head_config(target_cfg: ModelConfig) -> ModelConfig:
    """The head's layer is shaped like one of the target's layers."""
    return replace(target_cfg, n_layers=1, sliding_window=None, layer_types=None, local_rope_theta=None)


# -- which target a head belongs to -------------------------------------------------------------


def target_fingerprint(target: LoadedModel) -> dict:
    """What identifies the target: its architecture and a probe of its embedding matrix (a few
    rows and columns, compared by cosine so a dtype or quantization change still matches)."""
    c = target.config
    emb = target.model.model.embed_tokens.weight
    rows = torch.linspace(0, c.vocab_size - 1, PROBE_ROWS).long()
    probe = emb[rows.to(emb.device), :PROBE_DIMS].float().flatten().cpu()
    return {
        "name": Path(target.source).name,
        "architecture": {k: getattr(c, k) for k in ("model_type", "vocab_size", "dim", "n_layers", "n_heads",
                                                   "n_kv_heads", "head_dim")},
        "embedding_probe": [round(v, 6) for v in probe.tolist()],
    }


def check_target(trained_for: dict, target: LoadedModel, where: Path) -> None:
    mine = target_fingerprint(target)
    same = trained_for["architecture"] == mine["architecture"]
    if same:
        a, b = torch.tensor(trained_for["embedding_probe"]), torch.tensor(mine["embedding_probe"])
        same = float(torch.nn.functional.cosine_similarity(a, b, dim=0)) >= MIN_PROBE_COSINE
    if not same:
        raise SpeculantError(
            f"{where}: this EAGLE head was trained for target '{trained_for['name']}' "
            f"({_describe(trained_for['architecture'])}), not for the loaded target '{mine['name']}' "
            f"({_describe(mine['architecture'])}); train one for it with "
            "`speculant train-draft --kind eagle`")


def _describe(arch: dict) -> str:
    return f"{arch['model_type']}, {arch['n_layers']} layers, dim {arch['dim']}, vocab {arch['vocab_size']}"


def save_eagle(head: EagleHead, folder: Path, target: LoadedModel, dtype: torch.dtype = torch.bfloat16,
               training: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    config = {"architecture": "EagleHead", "head": asdict(head.cfg), "target": target_fingerprint(target),
              "training": training or {}}
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def load_eagle(folder: str | Path, target: LoadedModel) -> EagleHead:
    folder = Path(folder).expanduser()
    if not (folder / CONFIG).exists() or not (folder / WEIGHTS).exists():
        raise SpeculantError(f"{folder}: an EAGLE head folder needs {WEIGHTS} and {CONFIG}")
    config = json.loads((folder / CONFIG).read_text())
    check_target(config["target"], target, folder)
    state = load_file(str(folder / WEIGHTS))
    vocab = state.get("vocab")
    if vocab is not None and (vocab.dim() != 1 or not len(vocab) or int(vocab.min()) < 0
                              or int(vocab.max()) >= target.config.vocab_size):
        raise SpeculantError(f"{folder}: the head's draft vocabulary must list token ids in "
                             f"[0, {target.config.vocab_size}), the target's vocabulary")
    with torch.device("meta"):
        head = EagleHead(ModelConfig(**config["head"]), vocab)
    head.load_state_dict(state, assign=True)
    head.inv_freq = rope_inv_freq(head.cfg)
    model = target.model
    return pack_linears(head.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False))


# -- the proposer -------------------------------------------------------------------------------


class EagleProposer(Proposer):
    """Per sequence: the head's KV cache row, holding entries built from the target's real
    features, and the features the verifier returned that the head has not read yet (kept as the
    chunks each verify pass returned, joined when the head reads them: with lookup first or adaptive
    k the head may sit out many steps, and joining at every step grew with the wait)."""

    name = "eagle"

    def __init__(self, head: EagleHead, target: Transformer, max_batch_size: int, max_len: int,
                 tree_width: int = 1, max_depth: int = 1):
        self.head, self.target = head, target
        # A draft tree (draft_tree.py): k + tree_width − 1 nodes, tree_width children per grown node.
        self.tree_width = tree_width
        self.extra_nodes = tree_width - 1
        self.name = "eagle+tree" if tree_width > 1 else "eagle"
        self.lm_head = self.draft_head(head, target)
        self.vocab_size = target.cfg.vocab_size
        # A tree's head pass holds the branches of tree_width nodes of the depth before the deepest.
        self.cache = head.new_cache(max_batch_size, max_len + tree_width * max_depth)
        self.free = list(range(max_batch_size))
        self.slot: dict[str, int] = {}
        self.fed: dict[str, int] = {}  # head entries from real features: positions 0 .. fed-1
        self.pending: dict[str, list[torch.Tensor]] = {}  # target features of positions fed, fed+1, …
        self.n_pending: dict[str, int] = {}
        self.guessed: set[str] = set()  # rows whose head cache holds entries built from drafts

    def use_prefix_cache(self, capacity_bytes: int) -> bool:
        return False  # the head reads the target's features of every prompt position

    def add(self, seq: Sequence) -> None:
        rid = seq.request_id
        self.slot[rid] = self.free.pop(0)
        self.fed[rid] = 0
        self.pending[rid], self.n_pending[rid] = [], 0
        self.cache.rollback(self.slot[rid], 0)

    def remove(self, seq: Sequence) -> None:
        rid = seq.request_id
        self.cache.release(self.slot[rid])
        self.free.append(self.slot.pop(rid))
        del self.fed[rid], self.pending[rid], self.n_pending[rid]
        self.guessed.discard(rid)

    def propose(self, seqs: list[Sequence], ks: list[int], sb: SamplingBatch) -> Proposal:
        device = self.target.device
        k = max(ks)
        # Head entry t reads (feature t, token t+1): a row drafts once the target has returned the
        # features of every token but the newest (not before the first verify pass: no features).
        ready = [b for b, s in enumerate(seqs)
                 if ks[b] and self._unread(s) == self.n_pending[s.request_id] > 0]
        if not ready:
            return Proposal.empty(len(seqs), device)
        rows = [seqs[b] for b in ready]
        sub = sb.select(ready)
        feature = self._catch_up(rows)
        slots = torch.tensor([self.slot[s.request_id] for s in rows], device=device)
        if k > 1:
            self.guessed.update(s.request_id for s in rows)
        n_draft = torch.tensor([ks[b] for b in ready], device=device)
        if self.tree_width > 1:
            return self._draft_tree(feature, slots, n_draft.tolist()).placed(ready, len(seqs))
        drafts, qs = [], []
        for i in range(k):
            logits = self.lm_head(feature).float()  # [B, 1, N]
            token, q_i = self.draw_from_vocab(logits, sub.ahead(i))
            qs.append(q_i)
            drafts.append(token)
            if i < k - 1:
                embeds = self.embed(token[:, None])
                feature = self.head(embeds, feature, self.cache, slots)
        q = None if sb.all_greedy else torch.stack(qs, dim=1)
        return Proposal(torch.stack(drafts, dim=1), n_draft, q).placed(ready, len(seqs))

    def _draft_tree(self, feature: torch.Tensor, slots: torch.Tensor, ks: list[int]) -> Proposal:
        """Row b's draft tree of ks[b] + tree_width − 1 nodes, at most ks[b] deep (draft_tree.py), from the
        predicted feature of each row's newest token [B, 1, D].

        Each depth is one head pass over the branches of the nodes grown, the pass a tree itself so every
        node attends to its own ancestors only; it starts again from the head's real entries (those
        branches' keys are recomputed: a node's inputs, the embedding of its token and its parent's
        predicted feature, do not change).

        Every draft of a tree is deterministic (q one-hot, None), sampled requests too: a sampled row's
        verifier keeps a candidate with the target's own probability of it, after the candidates
        before it were rejected, so some candidate is kept with the target's probability of the whole
        set. A first draft drawn from the head's q is kept with probability 1 − TV(p, q), but after it
        is rejected the residual max(0, p − q) leaves little where the head is confident, where its
        other candidates are."""
        width, device = self.tree_width, feature.device
        trees = [DraftTree(k + width - 1, k) for k in ks]
        real = self.cache.lengths[slots].clone()  # the head's entries built from the target's features
        # Row b's predicted features: of its newest token (0), of its tree's node n (n + 1).
        features = feature.new_zeros(len(ks), 1 + width + width * width * (max(ks) - 1), feature.shape[-1])
        features[:, 0] = feature[:, 0]
        grown = [[-1] for _ in ks]
        while True:
            self._add_children(trees, grown, features)
            grown = [tree.frontier(width) for tree in trees]
            if not any(grown):
                break
            self._predict_features(trees, grown, features, slots, real)
        drafts, parents = zip(*(tree.best() for tree in trees))
        proposal = Proposal.from_lists(list(drafts), device)
        proposal.parents = [chain_padded(p, proposal.tokens.shape[1]) for p in parents]
        return proposal

    def _predict_features(self, trees: list[DraftTree], grown: list[list[int]], features: torch.Tensor,
                          slots: torch.Tensor, real: torch.Tensor) -> None:
        """One head pass over the branches of the nodes grown[b] of each row, from its `real` head
        entries; the grown nodes' predicted features go to `features` (see _draft_tree)."""
        device = features.device
        layout = branch_pass(trees, grown, device)
        rows, where = layout.rows, layout.where
        inputs = pad_rows([[trees[b].parents[n] + 1 for n in nodes] for b, nodes in zip(rows, layout.branches)],
                          device)[0]
        at = torch.tensor(rows, device=device)
        self.cache.lengths[slots[at]] = real[at]
        out = self.head(self.embed(layout.tokens), features[at[:, None], inputs], self.cache,
                        slots[at], layout.n_new, layout.parents)  # [B', T, D]
        for i, b in enumerate(rows):
            features[b, torch.tensor(grown[b], device=device) + 1] = out[i, [where[i][n] for n in grown[b]]]

    def _add_children(self, trees: list[DraftTree], grown: list[list[int]], features: torch.Tensor) -> None:
        """Give each node of grown[b] (-1: row b's newest token) its tree_width likeliest children by
        the head's log-softmax over the draft vocabulary, read from its predicted feature."""
        rows = [b for b, nodes in enumerate(grown) if nodes]
        n = max(len(grown[b]) for b in rows)
        index = torch.tensor([[node + 1 for node in grown[b]] + [0] * (n - len(grown[b])) for b in rows],
                             device=features.device)
        logits = self.lm_head(features[torch.tensor(rows, device=features.device)[:, None], index]).float()
        top = torch.log_softmax(logits, dim=-1).topk(self.tree_width, dim=-1)  # [B', n, width]
        ids, log_q = self._vocab_ids(top.indices).tolist(), top.values.tolist()
        for i, b in enumerate(rows):
            for j, node in enumerate(grown[b]):
                trees[b].add_children(node, ids[i][j], log_q[i][j])

    def _vocab_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary → the target's token ids."""
        return index if self.head.vocab is None else self.head.vocab[index]

    def draw_from_vocab(self, logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft token per row from logits over the draft vocabulary [B, 1, N] → full-vocabulary
        ids [B] and, when sampling, q over the full vocabulary [B, V] (0 outside the draft's)."""
        vocab = self.head.vocab
        return self.draw(logits, sb) if vocab is None else self.draw(logits, sb, vocab)

    def draft_head(self, head: EagleHead, target: Transformer) -> nn.Module:
        """What turns a predicted feature into logits over the draft vocabulary: the target's lm_head, restricted."""
        return draft_lm_head(target, head.vocab)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The head's input embeddings of `tokens` [B, T]: the target's (an EAGLE-3 head may carry its own)."""
        return self.target.embed(tokens)

    def _unread(self, seq: Sequence) -> int:
        """Head entries still to build: one per token of the sequence but the newest."""
        return len(seq.tokens) - 1 - self.fed[seq.request_id]

    def _catch_up(self, rows: list[Sequence]) -> torch.Tensor:
        """Feed the head every pending (feature, next token) pair; → the predicted feature of each
        row's newest token [B, 1, D]."""
        device = self.target.device
        pending = [torch.cat(self.pending[s.request_id]) for s in rows]
        features = pad_sequence(pending, batch_first=True)  # [B, T, D]
        fed = [self.fed[s.request_id] for s in rows]
        # The token after each pending feature's position.
        next_tokens, n_new = pad_rows([s.tokens[f + 1:f + 1 + len(p)] for s, f, p in zip(rows, fed, pending)], device)
        for s, p in zip(rows, pending):
            self.fed[s.request_id] += len(p)
            self.pending[s.request_id], self.n_pending[s.request_id] = [], 0
        slots = torch.tensor([self.slot[s.request_id] for s in rows], device=device)
        out = self.head(self.embed(next_tokens), features, self.cache, slots, n_new)
        return out[torch.arange(len(rows), device=device), n_new - 1][:, None]

    def commit(self, seqs: list[Sequence], target: TargetHidden) -> None:
        for b, s in enumerate(seqs):
            rid = s.request_id
            if rid not in self.slot:
                continue
            if rid in self.guessed:
                # The head's drafted entries were guesses: keep only those built from real features.
                self.cache.rollback(self.slot[rid], self.fed[rid])
                self.guessed.discard(rid)
            known = self.fed[rid] + self.n_pending[rid]  # positions whose feature we hold
            new = target.hidden[b, max(known - target.start[b], 0):target.n_valid[b]]
            if len(new):
                self.pending[rid].append(new.to(self.target.dtype))
                self.n_pending[rid] += len(new)
