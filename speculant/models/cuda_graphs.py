"""Static passes for a model's narrow passes (decoding steps, verify passes, draft trees), replayed on CUDA
from CUDA graphs.

At batch 1 a small model's pass on a GPU is hundreds of kernel launches of a few microseconds of work
each, so the CPU issuing them sets the pace, not the GPU. A captured graph replays them all in one
launch. A graph fixes its tensors' shapes and addresses, so the pass it records reads everything that
changes from step to step on the device: the tokens, the cache rows (slots) and the draft tree's layout
sit in input buffers each replay refills, the cache lengths are read where the cache keeps them, and the
pass attends over every position of the cache, the mask hiding those a row must not see. One graph per
(rows, width).

Lossless speculation needs a row scored alike alone and among the drafts of a verify pass (or the rows
of a batch). Two choices make it so:
- every pass attends over the same keys, the whole cache: with the span rounded up to a power of two
  instead, a verify pass crossing a boundary read more keys than the plain steps at the same positions,
  and bf16 speculative output parted from plain output;
- attention runs on PyTorch's math kernel: the cuDNN kernel it picks otherwise on an H200 gave a row of
  a verify pass other bits than the same row alone, the math kernel the same bits, as the bf16 linear
  layers give (tools/row_probe.py).
cuBLAS's fp32 products are not row-invariant there (a row differs in its last bits alone and among others): fp32
greedy speculation on CUDA can part from plain output where two tokens tie that closely; bf16, the default
on CUDA, does not. Eagerly (--enforce-eager) the same static passes run kernel by kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from speculant.models.attention import Pass, attention_mask, tree_layout
from speculant.models.kv_cache import CacheIndex, KVCache
from speculant.models.limits import MAX_VERIFY_WIDTH
from speculant.models.llama import Transformer
from speculant.models.rope import rope_tables

ATTENTION_BACKEND = SDPBackend.MATH  # row-invariant (module docstring); tools/attention_probe.py compares


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B, T] inputs, refilled before each replay
    slots: torch.Tensor  # [B]
    depth: torch.Tensor  # [B, T] each token's depth below the cache (its position past the row's length)
    ancestors: torch.Tensor  # [B, T] each token's ancestors and itself, a bit each (see tree_layout)
    hidden: torch.Tensor  # [B, T, D] the output, overwritten by each replay


def static_index(cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> CacheIndex:
    """cache.index without reading the slots on the host: every read is a gather of the rows' whole cache."""
    heads = torch.arange(cache.k.shape[2], device=slots.device)
    write = (slots[:, None, None], heads[None, :, None], positions[:, None, :])
    return CacheIndex(write, (slots,))


def use_static_passes(model: Transformer, replay: bool) -> None:
    """Run the model's narrow passes (decoding, verification) as static passes: replayed from CUDA graphs, or
    eagerly (`--enforce-eager`, tests on CPU). Models whose layers mix attention kinds (Gemma 3's local and global
    layers) keep prepared passes: a static pass holds one mask and one set of rotary tables. So do models with
    routed experts: which experts a pass runs depends on its tokens, which a captured graph cannot follow."""
    if len(model.cfg.attention_kinds) > 1 or model.cfg.n_experts:
        return
    model.narrow_passes = "graphs" if replay else "static"
    model.pass_graphs = PassGraphs


class PassGraphs:
    """The static passes of one model over one KV cache, on CUDA each shape captured on first use and
    replayed after (eagerly where the model's narrow_passes is "static": --enforce-eager, tests on CPU)."""

    def __init__(self, model: Transformer, cache: KVCache):
        self.model, self.cache = model, cache
        self.graphs: dict[tuple[int, int], Captured] = {}
        self.pool = None  # the graphs' shared memory, made by the first capture
        # Padding tokens past a row's end are rotated for positions up to a verify pass's width beyond the cache.
        self.cos, self.sin = rope_tables(model.inv_freq.to(cache.k.device), cache.max_len + MAX_VERIFY_WIDTH + 1,
                                         model.dtype, model.rope.scale)
        self.chains: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, n_new: torch.Tensor | None,
                 parents: list[list[int]] | None) -> torch.Tensor:
        """Transformer.forward's pass as a static pass: tokens [B, T ≤ MAX_VERIFY_WIDTH] → final hidden
        states [B, T, D]."""
        B, T = tokens.shape
        cache = self.cache
        end = cache.lengths[slots] + (T if n_new is None else n_new)
        cache.check_capacity(int(end.max()))
        if parents is None:
            depth, ancestors = self._chain(T)
        else:
            depths, bits = tree_layout(parents)
            depth, ancestors = (torch.tensor(v, device=tokens.device) for v in (depths, bits))
        if self.model.narrow_passes != "graphs" or not tokens.is_cuda:
            hidden = self.static_pass(tokens, slots, depth.expand(B, -1), ancestors.expand(B, -1))
            cache.lengths[slots] = end
            return hidden
        captured = self.graphs.get((B, T))
        if captured is None:
            captured = self.graphs[B, T] = self._capture(tokens, slots, depth, ancestors)
        else:
            for buffer, value in ((captured.tokens, tokens), (captured.slots, slots), (captured.depth, depth),
                                  (captured.ancestors, ancestors)):
                buffer.copy_(value)
            captured.graph.replay()
        cache.lengths[slots] = end
        # A copy: the next replay overwrites the graph's output, and proposers keep hidden states.
        return captured.hidden.clone()

    def _chain(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain of T tokens as a tree: token t at depth t, seeing tokens 0..t."""
        if T not in self.chains:
            steps = torch.arange(T, device=self.cache.k.device)
            self.chains[T] = (steps[None], ((2 << steps) - 1)[None])
        return self.chains[T]

    def _capture(self, tokens: torch.Tensor, slots: torch.Tensor, depth: torch.Tensor,
                 ancestors: torch.Tensor) -> Captured:
        """Record the pass for these inputs' shape. The warm-up runs (which cuBLAS needs before a capture)
        compute the real pass: it writes the same cache entries as the replays that follow."""
        B = tokens.shape[0]
        inputs = [tokens.clone(), slots.clone(), depth.expand(B, -1).clone(), ancestors.expand(B, -1).clone()]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                hidden = self.static_pass(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may use CUDA while the engine's thread captures.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = self.static_pass(*inputs)
        graph.replay()
        return Captured(graph, *inputs, hidden)

    def static_pass(self, tokens: torch.Tensor, slots: torch.Tensor, depth: torch.Tensor,
                    ancestors: torch.Tensor) -> torch.Tensor:
        """The pass as the graph records it: nothing read back to the host, every shape fixed. The caller
        advances the cache lengths."""
        model, cache = self.model, self.cache
        T = tokens.shape[1]
        start = cache.lengths[slots]  # [B]
        steps = torch.arange(T, device=tokens.device)
        # Padding past the cache's last position goes to its sink, as in prepare_pass.
        positions = (start[:, None] + steps).clamp(max=cache.max_len)  # [B, T]
        rotated = start[:, None] + depth
        span = cache.max_len + 1
        mask = attention_mask(rotated, start, span, model.cfg.sliding_window, model.dtype, ancestors)
        fwd = Pass(cache, slots, positions, span, mask, self.cos[rotated][:, :, None], self.sin[rotated][:, :, None],
                   end=None)
        fwd.at = static_index(cache, slots, positions)
        x = model.embed(tokens)
        with sdpa_kernel(ATTENTION_BACKEND):
            for block in model.model.layers:
                x = block(x, cache, fwd)
        return model.model.norm(x)
