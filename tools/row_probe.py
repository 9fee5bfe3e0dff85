"""Which operation of a bf16 pass scores a row differently alone and among 5 rows (CUDA)? Row 0 of a
1-token and a 5-token pass at the same position, recorded after every module of every layer, under each
attention backend; then each linear shape alone at 1 and 5 rows, eagerly and inside a CUDA graph.

    python tools/row_probe.py MODEL
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from speculant.models.loader import load_model

CONTEXT = 160


@torch.inference_mode()
def first_difference(model, graphs, cache, tokens, backend) -> str:
    seen: dict[int, list] = {1: [], 5: []}
    names = []

    def hook(name):
        def record(_module, _inputs, output):
            seen[current].append(output.reshape(-1, output.shape[-1])[0].float().clone())
            if current == 1:
                names.append(name)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if n.endswith(("qkv_proj", "o_proj", "self_attn", "gate_up_proj", "down_proj", "mlp"))]
    for current in (1, 5):
        cache.lengths[0] = CONTEXT
        d, a = graphs._chain(current)
        with sdpa_kernel(backend):
            out = graphs.static_pass(tokens[:, :current], torch.tensor([0], device="cuda"), d, a)
        seen[current].append(out[0, 0].float())
    for h in handles:
        h.remove()
    names.append("final")
    for name, x, y in zip(names, seen[1], seen[5]):
        if not torch.equal(x, y):
            return f"first difference after {name}: {(x - y).abs().max().item():.3g}; " \
                   f"final {(seen[1][-1] - seen[5][-1]).abs().max().item():.3g}"
    return "row 0 identical after every module"


@torch.inference_mode()
def linear_shapes() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for out, n_in in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        w = (torch.randn(out, n_in, device="cuda", generator=gen) / n_in ** 0.5).bfloat16()
        x = torch.randn(5, n_in, device="cuda", generator=gen).bfloat16()
        eager = (F.linear(x[:1], w)[0] - F.linear(x, w)[0]).abs().max().item()
        captured = {}
        for m in (1, 5):
            static = x[:m].clone()
            F.linear(static, w)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = F.linear(static, w)
            g.replay()
            captured[m] = y[0].clone()
        graph = (captured[1] - captured[5]).abs().max().item()
        vs = (captured[1] - F.linear(x[:1], w)[0]).abs().max().item()
        print(f"linear {out}x{n_in}: 1 vs 5 rows eager {eager:.3g}, in graphs {graph:.3g}; "
              f"graph vs eager at 1 row {vs:.3g}", flush=True)


def main() -> None:
    linear_shapes()
    model = load_model(sys.argv[1], dtype="bfloat16", device="cuda").model
    cache = model.new_cache(1, 1024)
    slot = torch.tensor([0], device="cuda")
    with torch.inference_mode():
        model(torch.randint(model.cfg.vocab_size, (1, CONTEXT), device="cuda"), cache, slot)
    graphs = model.graphs_for(cache)
    tokens = torch.randint(model.cfg.vocab_size, (1, 5), device="cuda")
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
        try:
            print(f"{backend.name}: {first_difference(model, graphs, cache, tokens, backend)}", flush=True)
        except RuntimeError as e:
            print(f"{backend.name}: {str(e).splitlines()[0][:150]}", flush=True)


if __name__ == "__main__":
    main()
