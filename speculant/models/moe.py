"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router scores every expert per token, each token runs
its top-k experts, and their outputs are summed with the router's weights.

A pass over N tokens runs only the union of the experts they chose, each over the tokens that chose it: a verify
pass of k + 1 tokens reads more experts' weights than a decoding step, which is why speculation's cost curve
is measured on the model itself (adaptive.py). Every product goes through the model's row-exact linear layers
(kernels.py), and each token sums its experts in expert order whatever its batch-mates chose, so a row's output
does not depend on the other rows of the pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from speculant.models import native
from speculant.models.kernels import PackedLinear, vectorized
from speculant.models.projections import native_projection

# Routing rules (families.Family.routing):
SOFTMAX_TOPK = "softmax_topk"  # softmax over every expert, the top k kept, renormalised if configured (Qwen3-MoE)
TOPK_SOFTMAX = "topk_softmax"  # the top k logits, softmax over those alone (Mixtral)
# Gemma 4: the router reads its input normed (no weight), times its own scale and 1/√D; softmax, top k,
# renormalised, each weight times its expert's scale.
SCALED_SOFTMAX_TOPK = "scaled_softmax_topk"
ROUTINGS = (SOFTMAX_TOPK, TOPK_SOFTMAX, SCALED_SOFTMAX_TOPK)


class MoE(nn.Module):
    """Replaces the gated MLP of a routed layer. `gate` is the router (the checkpoints' name), `experts` the
    experts, each a gated MLP made by `expert`."""

    def __init__(self, dim: int, n_experts: int, top_k: int, routing: str, renormalise: bool,
                 expert: Callable[[], nn.Module], shared: nn.Module | None = None, router_bias: bool = False):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing rule {routing!r}")
        self.top_k, self.routing, self.renormalise = top_k, routing, renormalise
        self.gate = nn.Linear(dim, n_experts, bias=router_bias)
        # Quantized router logits would move which experts a token gets (quantize.py skips it).
        self.gate.keep_precision = True
        self.experts = nn.ModuleList(expert() for _ in range(n_experts))
        if shared is not None:  # an expert every token runs, weighed by σ(its gate) (Qwen3.5-MoE, Qwen3-Next)
            self.shared_expert = shared
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
            self.shared_expert_gate.keep_precision = True
        if routing == SCALED_SOFTMAX_TOPK:
            self.router_scale = nn.Parameter(torch.ones(dim))
            self.per_expert_scale = nn.Parameter(torch.ones(n_experts))
            self.eps = 1e-6
        self._native = None  # native_experts(), built at the first pass (the weights are final by then)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] → (weights [N, k] in x's dtype, experts [N, k]), computed in fp32 as transformers does."""
        if self.routing == SCALED_SOFTMAX_TOPK:
            scaled = torch.nn.functional.rms_norm(x, x.shape[-1:], None, self.eps) * self.router_scale
            probs = torch.softmax(self.gate(scaled * x.shape[-1] ** -0.5).float(), dim=-1)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[chosen]
            return weights.to(x.dtype), chosen
        logits = self.gate(x)
        if self.routing == TOPK_SOFTMAX:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top.float(), dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
            if self.renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor, routed_by: torch.Tensor | None = None) -> torch.Tensor:
        """`routed_by`: what the router reads where it is not x (Gemma 4's: the layer's input before x's norm)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x if routed_by is None else routed_by.reshape(-1, shape[-1]))
        if (experts := self.native_experts(x)) is not None:
            return self.with_shared(x, experts.forward(x, chosen, weights)).view(shape)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending: each token sums its experts in one order
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            # A token takes an expert once, so rows are distinct: a plain gather and scatter (index_add_ was
            # slower than the expert's products on bf16 rows).
            out[rows] = out[rows] + self.experts[e](x[rows]) * weights[rows, slot, None]
        return self.with_shared(x, out).view(shape)

    def with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "shared_expert"):
            return routed
        return routed + vectorized(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)

    def native_parts(self, x: torch.Tensor) -> tuple[list[torch.Tensor], object | None]:
        """([router weight], experts) as csrc/decoder.cpp's routed layer takes them, for activations like x; the
        experts None where that layer cannot run this one: a shared expert, Gemma 4's scaled router (and any router
        with a bias: gpt-oss's), a router off the row-exact kernels
        decoder.cpp runs (PackedLinear's fp32 transposed or unpadded AMX bf16 layouts)."""
        gate, experts = self.gate, self.native_experts(x)
        usable = isinstance(gate, PackedLinear) and gate.bias is None and (
            gate.kind == "transposed" and gate.native or gate.kind == "amx" and not gate.padded_in)
        if hasattr(self, "shared_expert") or self.routing == SCALED_SOFTMAX_TOPK or not usable or experts is None:
            return [], None
        return [gate.weight], experts

    def native_experts(self, x: torch.Tensor) -> object | None:
        """csrc/moe.cpp's Experts over these experts' weights, where every expert is a SwiGLU MLP on native
        weights and x bf16 on a CPU: one call for the layer's experts, not a dozen PyTorch ops an expert."""
        if not native.layer_ops_usable(x):
            return None
        if self._native is None:
            gate_up = [native_projection(e.gate_up_proj) for e in self.experts]
            down = [native_projection(e.down_proj) for e in self.experts]
            usable = all(p is not None for p in gate_up + down) and all(e.activation == "silu" for e in self.experts)
            inner = self.experts[0].down_proj.in_features
            self._native = native.kernels().Experts(gate_up, down, inner) if usable else False
        return self._native or None


# The names checkpoints give an expert's projections: Qwen3-MoE's, and Mixtral's w1 (gate), w3 (up), w2 (down).
EXPERT_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                      "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
PER_EXPERT = re.compile(r"(.*\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
ROUTER = re.compile(r"(.*\.layers\.\d+\.)block_sparse_moe\.gate\.weight")
STACKED = re.compile(r"(.*\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)")
# gpt-oss: the router as mlp.router, the experts stacked transposed ([E, in, out]) with gate and up interleaved
# (gate the even columns), biases beside them.
GPT_OSS_ROUTER = re.compile(r"(.*\.layers\.\d+\.)mlp\.router\.(weight|bias)")
GPT_OSS_EXPERTS = re.compile(r"(.*\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


GEMMA4_ROUTER = {"proj.weight": "gate.weight", "scale": "router_scale", "per_expert_scale": "per_expert_scale"}
GEMMA4_MOE = re.compile(r"(.*\.layers\.\d+\.)(router\.(?:proj\.weight|scale|per_expert_scale)"
                        r"|experts\.(?:gate_up_proj|down_proj))")


def gemma4_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma 4's router and stacked experts (layers.N.router.*, layers.N.experts.*, beside the dense mlp) under
    the names the layer's `moe` loads."""
    out = {}
    for name, tensor in state.items():
        if not (m := GEMMA4_MOE.fullmatch(name)):
            out[name] = tensor
        elif m[2].startswith("router."):
            out[f"{m[1]}moe.{GEMMA4_ROUTER[m[2][7:]]}"] = tensor
        else:
            out |= expert_state({f"{m[1]}mlp.{m[2]}": tensor})
    return {k.replace(".mlp.experts.", ".moe.experts.") if ".mlp.experts." in k else k: v for k, v in out.items()}


def gpt_oss_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's router and stacked experts under the names MoE loads (its experts' gate_proj, up_proj and
    down_proj weights and biases, [out, in] as nn.Linear holds them)."""
    out = {}
    for name, tensor in state.items():
        if m := GPT_OSS_ROUTER.fullmatch(name):
            out[f"{m[1]}mlp.gate.{m[2]}"] = tensor
        elif m := GPT_OSS_EXPERTS.fullmatch(name):
            suffix = "bias" if m[3] else "weight"
            for e, w in enumerate(tensor.unbind(0)):
                w = w if m[3] else w.t()  # [in, out] → [out, in]
                if m[2] == "down_proj":
                    out[f"{m[1]}mlp.experts.{e}.down_proj.{suffix}"] = w.contiguous()
                else:
                    out[f"{m[1]}mlp.experts.{e}.gate_proj.{suffix}"] = w[0::2].contiguous()
                    out[f"{m[1]}mlp.experts.{e}.up_proj.{suffix}"] = w[1::2].contiguous()
        else:
            out[name] = tensor
    return out


def expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's experts under the names MoE loads (layers.N.mlp.gate, layers.N.mlp.experts.E.{gate,up,down}_proj):
    published checkpoints' per-expert tensors (Mixtral's block_sparse_moe.experts.E.w1/w2/w3 among them), and
    transformers' stacked ones (mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I])."""
    out = {}
    for name, tensor in state.items():
        if m := PER_EXPERT.fullmatch(name):
            if m[3] in EXPERT_PROJECTIONS:
                out[f"{m[1]}mlp.experts.{m[2]}.{EXPERT_PROJECTIONS[m[3]]}.weight"] = tensor
                continue
        elif m := ROUTER.fullmatch(name):
            out[f"{m[1]}mlp.gate.weight"] = tensor
            continue
        elif m := STACKED.fullmatch(name):
            for e, w in enumerate(tensor.unbind(0)):
                if m[2] == "down_proj":
                    out[f"{m[1]}mlp.experts.{e}.down_proj.weight"] = w
                else:
                    gate, up = w.chunk(2, dim=0)
                    out[f"{m[1]}mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{m[1]}mlp.experts.{e}.up_proj.weight"] = up
            continue
        out[name] = tensor
    return out
