"""Mixture-of-experts targets (Qwen3-MoE, Mixtral; models/moe.py) against transformers, from Hugging Face folders
and from GGUF files written from the same weights; speculative decoding on them equals plain greedy decoding,
alone and in a batch; a wrong routing rule is caught."""

from __future__ import annotations

import dataclasses
import functools
import re

import gguf
import numpy as np
import pytest
import torch
from conftest import greedy_tokens, reference_greedy_tokens, save_tiny, transformers
from mutants import ROUTING_MUTANTS, patch_routing
from safetensors.torch import load_file
from test_gguf import VOCAB, close, llama_permute, native_target, writer_for

from speculant.models.ggml import GGMLLinear
from speculant.models.gguf_native import native_loadable
from speculant.models.kernels import inexact_reason
from speculant.models.loader import load_model
from speculant.models.moe import MoE

Q = gguf.GGMLQuantizationType
TOL = 1e-4
N_TOKENS = 32
PROMPTS = [[5, 17, 33, 8, 60, 12], [40, 41, 42, 40, 41, 42, 40], [90, 3, 77, 21, 14, 9, 55, 31, 62],
           [200, 201, 202, 203, 200, 201, 202, 203, 200]]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, init_std=0.1,
              tie_word_embeddings=False)
FAMILIES = {
    # Three layers, the middle one dense (mlp_only_layers); norm_topk_prob off, where the routing rule matters.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        COMMON, num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, dict(
        COMMON, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2, intermediate_size=64)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, its transformers model, its folder, its GGUF file)."""
    name = request.param
    config_cls, overrides = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    folder = save_tiny(root / "hf", config_cls, seed=7, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = root / f"{name}.gguf"
    write_moe_gguf(path, name, ref.config, load_file(folder / "model.safetensors"))
    return name, ref, folder, path


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A dense draft with the targets' vocabulary and weights of its own: a poor guesser."""
    return save_tiny(tmp_path_factory.mktemp("draft") / "draft", seed=1, vocab_size=VOCAB, num_hidden_layers=1,
                     hidden_size=32, intermediate_size=64)


def write_moe_gguf(path, name: str, cfg, state: dict[str, torch.Tensor], qtype: Q | None = None,
                   per_expert: bool = False) -> None:
    """The checkpoint as llama.cpp's converter writes it: qwen3moe, or llama with experts (Mixtral); experts
    stacked [n_expert, …] (`per_expert`: one 2-D tensor each, blk.N.ffn_gate.E, as older Mixtral files), every
    matrix but the router in `qtype` (None: every tensor F32, as the converter writes it)."""

    def add(key: str, w: np.ndarray) -> None:
        if qtype is None or w.ndim == 1 or ".ffn_gate_inp." in key:
            writer.add_tensor(key, w)
        else:
            writer.add_tensor(key, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    arch = "qwen3moe" if name == "qwen3_moe" else "llama"
    n_experts = cfg.num_experts if name == "qwen3_moe" else cfg.num_local_experts
    writer = writer_for(path, arch, cfg, cfg.rope_parameters["rope_theta"],
                        "qwen2" if arch == "qwen3moe" else "default")
    writer.add_expert_count(n_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if name == "qwen3_moe":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             "block_sparse_moe.gate": "ffn_gate_inp"}
    experts = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
               "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
    stacked: dict[str, list] = {}
    for key, tensor in state.items():
        w = tensor.numpy()
        parts = key.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] != "layers":
            add(f"{names['.'.join(parts)]}.weight", w)
            continue
        layer, module = parts[1], ".".join(parts[2:])
        if "experts" in parts:  # layers.N.{mlp,block_sparse_moe}.experts.E.proj
            stacked.setdefault(f"blk.{layer}.{experts[parts[-1]]}.weight", []).append((int(parts[-2]), w))
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            w = llama_permute(w, cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads)
        add(f"blk.{layer}.{names[module]}.weight", w)
    for key, ws in stacked.items():
        if per_expert:
            for e, w in ws:
                add(key.replace("_exps.", f".{e}."), w)
        else:
            add(key, np.stack([w for _, w in sorted(ws, key=lambda e: e[0])]))
    close(writer)


def logits_error(model, ref, prompt: list[int]) -> float:
    """The largest |Δlogits| against transformers over a prefill, decode steps and a 3-token verify-like pass."""
    ids = torch.tensor([prompt])
    slot = torch.tensor([0])
    with torch.no_grad():
        expected = ref(ids).logits
        cache = model.new_cache(1, 64)
        n = len(prompt)
        got = [model.logits(model(ids[:, :n - 6], cache, slot))]
        got += [model.logits(model(ids[:, t:t + 1], cache, slot)) for t in range(n - 6, n - 3)]
        got += [model.logits(model(ids[:, n - 3:], cache, slot))]
    return (torch.cat(got, dim=1) - expected).abs().max().item()


greedy = functools.partial(greedy_tokens, n_tokens=N_TOKENS)


reference_greedy = functools.partial(reference_greedy_tokens, n_tokens=N_TOKENS)


LONG = [3, 50, 99, 140, 7, 64, 230, 18, 120, 45, 71, 9, 188, 33, 250, 101]


def test_folder_logits_and_greedy_tokens_equal_transformers(family):
    name, ref, folder, _ = family
    target = load_model(folder)
    routed = [isinstance(b.mlp, MoE) for b in target.model.model.layers]
    assert routed == ([True, False, True] if name == "qwen3_moe" else [True, True])
    err = logits_error(target.model, ref, LONG)
    print(f"{name}: max |Δlogits| {err:.2e}")
    assert err <= TOL
    assert greedy(target, PROMPTS) == [reference_greedy(ref, p) for p in PROMPTS]


def test_gguf_logits_and_greedy_tokens_equal_transformers(family, tmp_path, monkeypatch):
    name, ref, _, path = family
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    assert not native_loadable(path)  # F32 experts have no block kernel: the converted folder runs
    target = load_model(path, quantization="auto")
    n_experts = ref.config.num_experts if name == "qwen3_moe" else ref.config.num_local_experts
    assert (target.config.model_type, target.config.n_experts) == (name, n_experts)
    err = logits_error(target.model, ref, LONG)
    print(f"{name} GGUF: max |Δlogits| {err:.2e}")
    assert err <= TOL
    assert greedy(target, PROMPTS) == [reference_greedy(ref, p) for p in PROMPTS]


SPECS = [{"method": "ngram", "num_speculative_tokens": 4},
         {"method": "ngram", "num_speculative_tokens": 7},
         {"method": "draft_model", "num_speculative_tokens": 3},
         {"method": "draft_model", "num_speculative_tokens": 3, "tree_width": 2}]


def test_speculation_alone_and_in_a_batch_equals_plain_greedy(family, draft):
    """Each row alone and the four prompts as one batch (rows of different lengths and experts): plain decoding's
    tokens with every proposer, chains and trees."""
    target = load_model(family[2])
    plain = greedy(target, PROMPTS)
    assert greedy(target, PROMPTS, max_batch_size=4) == plain
    for spec in SPECS:
        spec = {**spec, "model": str(draft)} if spec["method"] == "draft_model" else spec
        assert greedy(target, PROMPTS, spec) == plain, spec
        assert greedy(target, PROMPTS, spec, max_batch_size=4) == plain, spec


def test_router_is_never_quantized(family):
    target = load_model(family[2], quantization="int8")
    layer = target.model.model.layers[0].mlp
    assert type(layer.gate).__name__ != "Int8Linear" and type(layer.experts[0].down_proj).__name__ == "Int8Linear"


@pytest.mark.parametrize("mutant", list(ROUTING_MUTANTS))
def test_a_wrong_routing_rule_is_caught(family, mutant, monkeypatch):
    name, ref, folder, _ = family
    if ROUTING_MUTANTS[mutant] != name:
        pytest.skip(f"{mutant} is {ROUTING_MUTANTS[mutant]}'s mutant")
    patch_routing(mutant, monkeypatch)
    assert logits_error(load_model(folder).model, ref, LONG) > 100 * TOL


def test_cost_probe_runs_the_experts_distinct_tokens_choose(family, monkeypatch):
    """Adaptive k's cost curve times passes whose tokens are distinct, after a real prompt pass: a wider pass runs
    more experts, as a verify pass does."""
    from speculant.speedup import measure_cost_curve

    target = load_model(family[2]).model
    runs: dict[int, list[int]] = {}
    forward = MoE.forward

    def counting(self, x):
        if self is target.model.layers[0].mlp:
            runs.setdefault(x.shape[1], []).append(len(torch.unique(self.route(x.reshape(-1, x.shape[-1]))[1])))
        return forward(self, x)

    monkeypatch.setattr(MoE, "forward", counting)
    measure_cost_curve(target, [1], max_width=6, context=16, reps=1)
    assert 16 in runs  # the prompt pass
    assert min(runs[6]) > max(runs[1]) == target.cfg.experts_per_token


@pytest.fixture(scope="module")
def blocks(family, tmp_path_factory):
    """The family's weights as a Q8_0 GGUF file, experts stacked, and the same weights one tensor an expert."""
    name, ref, folder, _ = family
    root = tmp_path_factory.mktemp(f"{name}-q8_0")
    files = {}
    for layout in ("stacked", "per_expert"):
        files[layout] = root / f"{name}-{layout}.gguf"
        write_moe_gguf(files[layout], name, ref.config, load_file(folder / "model.safetensors"), Q.Q8_0,
                       per_expert=layout == "per_expert")
    return files


def test_gguf_experts_run_on_their_own_blocks(family, blocks):
    """Stacked Q8_0 experts on the native kernels, one expert a matrix: near the same blocks dequantized, and
    speculation and batches give the file's own plain output, alone and in a batch."""
    target = native_target(blocks["stacked"])
    moe = next(b.mlp for b in target.model.model.layers if isinstance(b.mlp, MoE))
    assert isinstance(moe.experts[0].down_proj, GGMLLinear)
    # The router too gives a row the same bits in any pass (else a verify pass may route a token elsewhere).
    assert inexact_reason(target.model, torch.device("cpu")) is None
    ids = torch.tensor([LONG])
    expected = logits_of(load_model(blocks["stacked"]).model, ids)  # the same blocks dequantized, in fp32
    assert (logits_of(target.model, ids) - expected).abs().max().item() < 0.05 * expected.abs().max().item()
    plain = greedy(target, PROMPTS)
    assert greedy(target, PROMPTS, max_batch_size=4) == plain
    for spec in SPECS[:2]:
        assert greedy(target, PROMPTS, spec) == plain, spec
        assert greedy(target, PROMPTS, spec, max_batch_size=4) == plain, spec


def test_per_expert_tensors_are_the_stacked_experts(blocks):
    """Older Mixtral files (blk.N.ffn_gate.E.weight) load into the same matrices as stacked ones: the same logits."""
    ids = torch.tensor([LONG])
    stacked = logits_of(native_target(blocks["stacked"]).model, ids)
    assert torch.equal(logits_of(native_target(blocks["per_expert"]).model, ids), stacked)


def test_experts_in_the_wrong_places_are_caught(family, blocks, monkeypatch):
    """A mutant that hands each expert its neighbour's blocks moves the logits far: the test above can fail."""
    from speculant.models import gguf_native

    ids = torch.tensor([LONG])
    right = logits_of(native_target(blocks["stacked"]).model, ids)
    split = gguf_native.matrices

    def shifted(reader):  # expert e's up projection read from expert e + 1's blocks
        out = split(reader)
        n = sum(".ffn_up." in m.name for m in out) // sum(".ffn_up.0." in m.name for m in out)
        return [dataclasses.replace(m, name=re.sub(r"\.ffn_up\.(\d+)\.", lambda e: f".ffn_up.{(int(e[1]) + 1) % n}.",
                                                   m.name)) for m in out]

    monkeypatch.setenv("SPECULANT_CACHE", str(blocks["stacked"].parent / "mutant-cache"))
    monkeypatch.setattr(gguf_native, "matrices", shifted)
    wrong = logits_of(native_target(blocks["stacked"]).model, ids)
    assert (right - wrong).abs().max().item() > 0.05 * right.abs().max().item()


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, model.new_cache(1, 64), torch.tensor([0]))).float()


def test_native_experts_are_the_loop_bit_for_bit(blocks):
    """csrc/moe.cpp's one call and the Python loop over experts give the same bits, for a decode row and a batch
    of rows that chose different experts."""
    target = native_target(blocks["stacked"])
    moe = next(b.mlp for b in target.model.model.layers if isinstance(b.mlp, MoE))
    x = torch.randn(7, target.config.dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert moe.native_experts(x) is not None
    fast = [moe(x[:1]), moe(x)]
    moe._native = False
    assert all(torch.equal(a, b) for a, b in zip(fast, [moe(x[:1]), moe(x)]))


def test_a_conversion_streams_in_shards(family, tmp_path, monkeypatch):
    """Where the converted folder is still made (F32 experts have no block kernel), it is written a shard at a
    time: several shards where the model passes the limit, and the same logits as one file."""
    from speculant.models import gguf as conv

    name, ref, _, path = family
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "whole"))
    whole = logits_of(load_model(path).model, torch.tensor([LONG]))
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "sharded"))
    monkeypatch.setattr(conv, "SHARD_BYTES", 64 << 10)
    folder, _ = conv.convert_gguf(path)
    assert len(list(folder.glob("model-*.safetensors"))) > 2 and not (folder / "model.safetensors").exists()
    assert torch.equal(logits_of(load_model(path).model, torch.tensor([LONG])), whole)



# The native attention's smallest head is 32: the families' tiny shapes above run as modules.
WIDE_HEADS = {"qwen3_moe": dict(head_dim=32), "mixtral": dict(hidden_size=128)}


def test_native_stack_runs_routed_layers_with_the_bits_of_the_modules(family, tmp_path, monkeypatch):
    """Routed layers inside csrc/decoder.cpp's whole-stack decoder: prefill, one token, a verify pass and a ragged
    batch give the bits the layer modules give; each routing rule dropped from the native layer changes them."""
    from test_native_families import module_passes, passes, with_form

    from speculant.models import native

    name = family[0]
    config_cls, overrides = FAMILIES[name]
    folder = save_tiny(tmp_path / "hf", config_cls, seed=7, **dict(overrides, **WIDE_HEADS[name]))
    config = transformers.AutoConfig.from_pretrained(folder)
    path = tmp_path / f"{name}-q8_0.gguf"
    write_moe_gguf(path, name, config, load_file(folder / "model.safetensors"), Q.Q8_0)
    model = native_target(path).model
    assert model.native_stack is not None and model.native_decode
    fused, _ = passes(model)
    modules, _ = module_passes(model, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))
    layers = [block.native_weights for block in model.model.layers]
    routed = lambda change: [change(layer) if layer.experts else layer for layer in layers]  # noqa: E731
    mutants = {"one_expert_fewer": lambda layer: with_form(layer, 5, layer.form[5] - 1),
               # (softmax over the top k equals the top k of the softmax renormalised: the rule flips unnormalised)
               "other_rule": lambda layer: with_form(with_form(layer, 6, not layer.form[6]), 7, False)}
    if model.cfg.routing != "topk_softmax":
        mutants["renormalised"] = lambda layer: with_form(layer, 7, not layer.form[7])
    for mutant, change in mutants.items():
        stack = native.decoder_stack(routed(change), model.model.norm.weight, model.cfg.n_heads,
                                     model.cfg.n_kv_heads, model.embed_scale)
        monkeypatch.setattr(model, "native_stack", stack)
        mutated, _ = passes(model)
        assert any(not torch.equal(a, b) for a, b in zip(mutated, modules)), mutant
