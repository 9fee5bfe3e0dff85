"""Our decoder against transformers (the reference): logits through prefill, decode steps,
rollback; ragged batches; every supported architecture, float32."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny, transformers

from speculant.errors import SpeculantError
from speculant.models.kv_cache import KVCache
from speculant.models.loader import load_model

TOL = 1e-4
# Phi-3.5-style LongRoPE on the tiny model's head size 16: 8 frequencies, each with its own short and long factor;
# trained for 256 positions, stretched to 1024 (so the attention factor is not 1).
PHI3_LONGROPE = dict(max_position_embeddings=1024, original_max_position_embeddings=256,
                     rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                   "long_factor": [2.0 + 0.2 * i for i in range(8)]})
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3_rope_tied": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "smollm2_like": (transformers.LlamaConfig, dict(tie_word_embeddings=True, rope_theta=100000.0,
                                                     num_attention_heads=8, num_key_value_heads=2)),
    "phi3_longrope": (transformers.Phi3Config, dict(PHI3_LONGROPE, pad_token_id=0)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_match_transformers(tmp_path, arch):
    config_cls, overrides = ARCHITECTURES[arch]
    folder = save_tiny(tmp_path, config_cls, seed=0, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder).model
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    slot = torch.tensor([0])
    with torch.no_grad():
        expected = ref(ids).logits
        cache = model.new_cache(1, 64)
        got = [model.logits(model(ids[:, :16], cache, slot))]  # prefill
        got += [model.logits(model(ids[:, t:t + 1], cache, slot)) for t in range(16, 24)]  # decode
        got = torch.cat(got, dim=1)
        cache.rollback(0, 21)  # drop the last 3 tokens, then decode them again
        redo = model.logits(model(ids[:, 21:24], cache, slot))
    err, err_redo = (got - expected).abs().max().item(), (redo - expected[:, 21:]).abs().max().item()
    print(f"{arch}: max |Δlogits| prefill+decode {err:.2e}, after rollback {err_redo:.2e}")
    assert err <= TOL and err_redo <= TOL


def test_ragged_batch_equals_each_sequence_alone(tiny_pair):
    model = load_model(tiny_pair[0]).model
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 3, 12, 1)]
    with torch.no_grad():
        alone = []
        for p in prompts:
            cache = model.new_cache(1, 32)
            alone.append(model.logits(model(p[None], cache, torch.tensor([0])))[0])
        cache = model.new_cache(6, 32)
        slots = torch.tensor([4, 1, 2, 5])  # not contiguous: the gather path
        tokens = torch.zeros(4, 12, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        n_new = torch.tensor([len(p) for p in prompts])
        batched = model.logits(model(tokens, cache, slots, n_new))
        # one more ragged decode step on top of different lengths
        step = torch.tensor([[5], [6], [7], [8]])
        batched_step = model.logits(model(step, cache, slots))
    for b, p in enumerate(prompts):
        assert (batched[b, :len(p)] - alone[b]).abs().max() <= TOL
        cache1 = model.new_cache(1, 32)
        with torch.no_grad():
            model(p[None], cache1, torch.tensor([0]))
            single = model.logits(model(step[b:b + 1], cache1, torch.tensor([0])))
        assert (batched_step[b] - single[0]).abs().max() <= TOL
    assert cache.lengths[slots].tolist() == [8, 4, 13, 2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_at_the_end_of_its_context_shares_a_pass_with_a_long_row(tiny_pair, dtype):
    """Row 0 has 1 position left, row 1 feeds 12 tokens: row 0's padding would run 11 positions past
    its cache's end; it goes to the sink and row 0's real entry is what it is alone."""
    model = load_model(tiny_pair[0], dtype=dtype).model
    gen = torch.Generator().manual_seed(3)
    history, last, long_row = (torch.randint(0, 96, (n,), generator=gen) for n in (15, 1, 12))
    with torch.no_grad():
        alone = model.new_cache(1, 16)
        model(history[None], alone, torch.tensor([0]))
        expected = model.logits(model(last[None], alone, torch.tensor([0])))[0, 0]
        cache = model.new_cache(2, 16)
        model(history[None], cache, torch.tensor([0]))
        tokens = torch.stack((torch.cat((last, torch.zeros(11, dtype=torch.long))), long_row))
        got = model.logits(model(tokens, cache, torch.tensor([0, 1]), torch.tensor([1, 12])))
        assert cache.lengths.tolist() == [16, 12]
        assert (got[0, 0].float() - expected.float()).abs().max() <= (TOL if dtype == "float32" else 0.05)
        with pytest.raises(SpeculantError, match="needs 24 cache positions; the cache holds 16"):
            model(tokens, cache, torch.tensor([0, 1]), torch.tensor([1, 12]))
        assert cache.lengths.tolist() == [16, 12]  # a refused pass writes nothing


def test_bfloat16_runs_close_to_float32(tiny_pair):
    ids = torch.tensor([[3, 9, 27, 81 % 96, 5]])
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(tiny_pair[0], dtype=dtype).model
        with torch.no_grad():
            out[dtype] = model.logits(model(ids, model.new_cache(1, 8), torch.tensor([0])))
    assert out["bfloat16"].dtype == torch.float32  # logits are always returned in fp32
    assert (out["bfloat16"] - out["float32"]).abs().max() < 0.1


@pytest.mark.parametrize("native_attention", [True, False])
def test_bfloat16_verify_pass_equals_single_steps_bitwise(tmp_path, monkeypatch, native_attention):
    """A k+1-wide verify pass must give each row the very logits plain decoding gives it, or bf16
    speculation would flip near-ties. SmolLM2's attention shape (9 query heads, 3 key heads of 64);
    with the native kernels and with the fallback (PyTorch's attention row by row, its layer operations)."""
    from speculant.models import native

    if native_attention and not native.attention_usable(64):
        pytest.skip("the native attention kernel does not run here (no AVX2, or no compiler)")
    if not native_attention:
        monkeypatch.setattr(native, "attention_usable", lambda head_dim: False)
        monkeypatch.setattr(native, "layer_ops_usable", lambda x: False)
    folder = save_tiny(tmp_path, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=256, init_std=0.05)
    model = load_model(folder, dtype="bfloat16").model
    ids = torch.randint(0, 96, (1, 72), generator=torch.Generator().manual_seed(0))
    slot = torch.tensor([0])
    for prefix in (30, 31, 60):  # key counts that fall differently on the kernel's vector blocks
        with torch.no_grad():
            cache = model.new_cache(1, 72)
            model(ids[:, :prefix], cache, slot)
            steps = range(prefix, prefix + 6)
            single = torch.cat([model.logits(model(ids[:, t:t + 1], cache, slot)) for t in steps], 1)
            cache.rollback(0, prefix)
            wide = model.logits(model(ids[:, prefix:prefix + 6], cache, slot))
        assert torch.equal(single, wide), f"prefix {prefix}: max |Δ| {(single - wide).abs().max():.3g}"


def test_bfloat16_batch_rows_equal_single_rows_bitwise(tmp_path):
    """With the native attention kernel a bf16 row scores the same bits in a ragged batch (other rows,
    padding, several new tokens) as alone, one token at a time: batched speculation stays exact."""
    from speculant.models import native

    if not native.attention_usable(64):
        pytest.skip("the native attention kernel does not run here (no AVX2, or no compiler)")
    folder = save_tiny(tmp_path, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=256, init_std=0.05)
    model = load_model(folder, dtype="bfloat16").model
    gen = torch.Generator().manual_seed(1)
    # 8 rows × 5 tokens: 40 rows per linear layer, past the 32 oneDNN keeps row-exact in one call.
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (20, 7, 33, 12, 3, 40, 9, 25)]
    steps = torch.randint(0, 96, (8, 5), generator=gen)
    with torch.no_grad():
        cache, slots = model.new_cache(8, 64), torch.arange(8)
        for b, p in enumerate(prompts):
            model(p[None], cache, slots[b:b + 1])
        n_new = torch.tensor([5, 2, 4, 1, 5, 3, 5, 1])
        batched = model.logits(model(steps, cache, slots, n_new))
        for b, p in enumerate(prompts):
            alone = model.new_cache(1, 64)
            model(p[None], alone, torch.tensor([0]))
            for t in range(int(n_new[b])):
                single = model.logits(model(steps[b:b + 1, t:t + 1], alone, torch.tensor([0])))
                assert torch.equal(single[0, 0], batched[b, t]), (b, t)


def test_native_layer_ops_match_pytorch_in_fp32_and_give_a_row_the_same_bits_in_any_call():
    """RMSNorm (alone, with the residual sum before it: PyTorch's sum's bits, or of each q and k head: rms_norm's
    bits), rotary embedding, silu(gate)·up and gelu_tanh(gate)·up, one call each: within bf16 rounding of an fp32
    computation, sizes that are not multiples of the vector width included, and a row's bits do not depend on
    the other rows of the call."""
    import torch.nn.functional as F

    from speculant.models import native
    from speculant.models.rope import rope_tables

    if native.kernels() is None:
        pytest.skip(native.off_reason())
    gen = torch.Generator().manual_seed(0)

    def close(got, ref):
        return ((got.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5).all()  # one bf16 rounding

    for D in (576, 100):
        x, w = torch.randn(3, 7, D, generator=gen).bfloat16(), torch.randn(D, generator=gen).bfloat16()
        y = native.rms_norm(x, w, 1e-5)
        assert close(y, F.rms_norm(x.float(), (D,), w.float(), 1e-5))
        assert torch.equal(native.rms_norm(x[1:2, 3:4], w, 1e-5), y[1:2, 3:4])
        residual = torch.randn(3, 7, D, generator=gen).bfloat16()
        total, normed = native.add_rms_norm(x, residual, w, 1e-5)  # the sum and its norm in one call
        assert torch.equal(total, x + residual) and torch.equal(normed, native.rms_norm(x + residual, w, 1e-5))

        gate_up = torch.randn(3, 7, 2 * D, generator=gen).bfloat16() * 4
        gate, up = gate_up.float().chunk(2, dim=-1)
        y = native.silu_mul(gate_up)
        assert close(y, F.silu(gate) * up)
        assert torch.equal(native.silu_mul(gate_up[2:3, :1]), y[2:3, :1])
        y = native.gelu_tanh_mul(gate_up)  # GeGLU (Gemma)
        assert close(y, F.gelu(gate, approximate="tanh") * up)
        assert not close(y, F.gelu(gate) * up)  # the tanh form, not the exact GELU
        assert torch.equal(native.gelu_tanh_mul(gate_up[2:3, :1]), y[2:3, :1])

        heads = torch.randn(5, 6, D, generator=gen).bfloat16()  # q/k norms: 4 query heads, then 2 key heads
        q_w, k_w = torch.randn(D, generator=gen).bfloat16(), torch.randn(D, generator=gen).bfloat16()
        normed = heads.clone()
        native.kernels().head_norms_(normed, q_w, k_w, 4, 2, 1e-6)
        assert torch.equal(normed[:, :4], native.rms_norm(heads[:, :4], q_w, 1e-6))
        assert torch.equal(normed[:, 4:], native.rms_norm(heads[:, 4:], k_w, 1e-6))

    for head_dim in (64, 40):
        cos, sin = rope_tables(torch.rand(head_dim // 2, generator=gen), 50, torch.bfloat16)
        positions = torch.randint(0, 50, (2, 4), generator=gen)
        c, s = cos[positions][:, :, None], sin[positions][:, :, None]
        x = torch.randn(2, 4, 15, head_dim, generator=gen).bfloat16()
        heads = x[:, :, :12].float()
        ref = heads * c.float() + heads.roll(head_dim // 2, -1) * s.float()
        y = x.clone()
        native.rope_(y, c, s, 12)
        assert close(y[:, :, :12], ref) and torch.equal(y[:, :, 12:], x[:, :, 12:])
        one = x[1:2, 2:3].clone()
        native.rope_(one, c[1:2, 2:3], s[1:2, 2:3], 12)
        assert torch.equal(one, y[1:2, 2:3])


@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_fused_layers_give_the_bits_of_the_layer_modules(tmp_path, monkeypatch, quantization):
    """native.decoder_stack (one call a pass, its parallel loops on one team of threads; int4 and bf16
    weights) against llama.Block's modules on the same weights: one token, a verify pass, a ragged batch
    in cache rows out of order; logits and cache bit for bit."""
    from speculant.models import native

    if quantization == "none" and not native.amx():
        pytest.skip("the bf16 native kernels need AMX (none here): bf16 layers run as modules")
    if native.level() == "off":
        pytest.skip(native.off_reason())
    if quantization == "int4" and not native.quantized_usable(128, 128):
        pytest.skip(f"the int4 kernel needs the avx512 build; this CPU's level is {native.level()}: int4 layers "
                    "run as modules")
    folder = save_tiny(tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=256, init_std=0.05)
    model = load_model(folder, dtype="bfloat16", quantization=quantization).model
    assert model.native_stack is not None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (40, 9, 23)]
    steps = [torch.randint(0, 96, (len(prompts), t), generator=gen) for t in (1, 5, 3)]

    def decode() -> tuple[list[torch.Tensor], KVCache]:
        cache, slots = model.new_cache(4, 64), torch.tensor([2, 0, 3])
        with torch.no_grad():
            for slot, p in zip(slots, prompts):
                model(p[None], cache, slot[None])
            out = [model.logits(model(steps[0][:1], cache, slots[:1])),
                   model.logits(model(steps[1][:1], cache, slots[:1])),
                   model.logits(model(steps[2], cache, slots, torch.tensor([3, 1, 2])))]
        return out, cache

    fused, fused_cache = decode()
    # An error inside the pass (a position past the cache: the Python side refuses it before) reaches the
    # caller from the stack's team of threads, and the next passes run as before.
    cache = model.new_cache(1, 64)
    x = torch.zeros(1, 1, model.cfg.dim, dtype=torch.bfloat16)
    cos = torch.ones(1, 1, 1, model.cfg.head_dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cache position out of range"):
        model.native_stack.forward(x, cos, torch.zeros_like(cos), cache.k, cache.v, torch.tensor([0]),
                                   torch.tensor([[cache.k.shape[3] + 1]]), None)
    again, _ = decode()
    assert all(torch.equal(a, b) for a, b in zip(again, fused))
    monkeypatch.setattr(model, "native_stack", None)
    modules, module_cache = decode()
    real = torch.arange(3) < torch.tensor([3, 1, 2])[:, None]  # the ragged pass's padding is nobody's output
    for a, b in zip(fused[:2] + [fused[2][real]], modules[:2] + [modules[2][real]]):
        assert torch.equal(a, b), f"max |Δ| {(a - b).abs().max():.3g}"
    assert torch.equal(fused_cache.lengths, module_cache.lengths)
    for slot, n in enumerate(fused_cache.lengths.tolist()):  # past a row's length lie padding keys, never read
        assert torch.equal(fused_cache.k[:, slot, :, :n], module_cache.k[:, slot, :, :n])
        assert torch.equal(fused_cache.v[:, slot, :, :n], module_cache.v[:, slot, :, :n])


@pytest.mark.parametrize("amx", [True, False])
def test_int4_keeps_weights_already_on_a_q4_1_grid(monkeypatch, amx):
    """A layer whose weights are w = d·q + m per 32 (what a Q4_1 GGUF file holds) comes back on the
    same grid: only bf16 rounding of the products remains (AMX kernel, and PyTorch's where it is not)."""
    from speculant.models import native
    from speculant.models.quantize import Int4Linear

    if amx and not native.quantized_usable(64, 128):
        pytest.skip(native.off_reason() if native.level() == "off" else
                    f"the int4 kernel needs the avx512 build; this CPU's level is {native.level()}")
    if not amx:
        monkeypatch.setattr(native, "quantized_usable", lambda out_features, in_features: False)

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's Q4_1 puts each group's minimum at 0 and maximum at 15
    d = torch.rand(64, 4, 1, generator=gen) * 0.01 + 0.001
    m = -torch.rand(64, 4, 1, generator=gen) * 0.05
    linear = torch.nn.Linear(128, 64, bias=False)
    linear.weight.data = (d * q + m).view(64, 128)
    x = torch.randn(5, 128, generator=gen)
    layer = Int4Linear(linear)
    assert layer.native == amx
    got = layer(x)
    err = ((got - linear(x)).norm() / linear(x).norm()).item()
    assert err < 0.01, err  # bf16 activations and scales; a 4-bit requantization off the grid is ~8%


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int4 kernel reads it: per group of 32, dx·round(x/dx) with dx = max|x|/127 (llama.cpp's)."""
    groups = x.float().view(x.shape[0], -1, 32)
    dx = groups.abs().amax(-1, keepdim=True) / 127
    return torch.where(dx > 0, torch.round(groups / dx) * dx, 0.0).view(x.shape)


@pytest.mark.parametrize("N", [96, 80])
def test_amx_int4_kernel_gives_every_row_the_same_result_whatever_the_row_count(N):
    """A verify pass scores k + 1 rows, plain decoding one: the kernel must give a row the same bits in
    both, from 1 to 8 rows (VNNI, two blocks of 16 outputs at a time, or one where a thread's share is
    odd: 80 outputs) and above (AMX tiles), and be within bf16 rounding of the float product of the Q4_1
    weights and the int8 activations it reads."""
    from speculant.models import native

    if native.level() == "off":
        pytest.skip(native.off_reason())
    if not native.quantized_usable(N, 192):
        pytest.skip(f"the int4 kernel needs the avx512 build; this CPU's level is {native.level()}")
    gen = torch.Generator().manual_seed(0)
    K = 192
    q = torch.randint(0, 16, (N, K), generator=gen)
    d = (torch.rand(N, K // 32, generator=gen) * 0.01 + 0.001).bfloat16().float()
    m = (-torch.rand(N, K // 32, generator=gen) * 0.05).bfloat16().float()
    w = (q.view(N, K // 32, 32) * d[..., None] + m[..., None]).view(N, K)
    x = torch.randn(40, K, generator=gen).bfloat16()
    x[5, 32:64] = 0  # a group of zeros: scale 0 (in a batch of 16 groups quantized together, and alone below)
    weights = native.int4_layout(q, d, m)
    y = native.int4_mm(x, *weights)
    ref = q8_activations(x) @ w.T
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.003
    assert ((y.float() - x.float() @ w.T).norm() / ref.norm()).item() < 0.01
    for rows in range(1, 41):
        assert torch.equal(native.int4_mm(x[:rows], *weights), y[:rows]), rows
    assert torch.equal(native.int4_mm(x[7:8], *weights), y[7:8])  # and whatever rows come before it
    assert torch.equal(native.int4_mm(x[5:6], *weights), y[5:6])


def test_int4_models_lm_head_is_int8_in_groups_on_its_q8_0_grid_and_row_exact(tiny_pair):
    """Under int4 the lm_head goes to int8 in groups of 32 (Q8_0, the way GGUF files keep the embedding)
    on the native kernel: weights already on a Q8_0 grid (bf16 scales) are stored as they are, the product
    is within bf16 rounding of the float product of those weights and the int8 activations it reads, and
    a row gets the same bits alone or among 40 (VNNI up to 8 rows, AMX tiles above)."""
    from speculant.models import native
    from speculant.models.quantize import Int8GroupLinear

    if not native.quantized_usable(64, 128):
        pytest.skip(native.off_reason() if native.level() == "off" else
                    f"the int8 kernel needs the avx512 build; this CPU's level is {native.level()}")
    assert isinstance(load_model(tiny_pair[0], dtype="bfloat16", quantization="int4").model.lm_head, Int8GroupLinear)
    gen = torch.Generator().manual_seed(0)
    N, K = 96, 192
    q = torch.randint(-127, 128, (N, K // 32, 32), generator=gen)
    q[..., 0] = 127  # llama.cpp's Q8_0 scales each group to its largest magnitude
    d = (torch.rand(N, K // 32, generator=gen) * 0.01 + 0.001).bfloat16().float()
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = (q * d[..., None]).view(N, K)
    layer = Int8GroupLinear(linear)
    packed, scale = native.int8_layout(q.view(N, K).to(torch.int8), d)
    assert torch.equal(layer.weight, packed) and torch.equal(layer.scale, scale)
    x = torch.randn(40, K, generator=gen).bfloat16()
    y = layer(x)
    ref = q8_activations(x) @ linear.weight.T
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.005
    assert ((y.float() - x.float() @ linear.weight.T).norm() / ref.norm()).item() < 0.02  # int8 inputs: ~0.6%
    for rows in range(1, 41):
        assert torch.equal(layer(x[:rows]), y[:rows]), rows
    assert torch.equal(layer(x[7:8]), y[7:8])


@pytest.mark.parametrize("amx", [True, False])
def test_packed_bf16_linear_gives_every_row_the_same_bits_whatever_the_row_count(monkeypatch, amx):
    """The native bf16 kernels (AMX tiles, or bf16_dot.cpp without them) compute every row alike; oneDNN's
    packed bf16 kernel (where they do not run) is row-exact up to 32 rows only on this shape (measured: on
    SmolLM2's qkv shape a 40-row call changed rows 1, 6, 16 …), so a batched verify pass goes to it in
    chunks. tests/models/test_row_invariance.py checks every kind at 1 to 700 rows."""
    from speculant.models import native
    from speculant.models.kernels import PackedLinear, fast_bfloat16

    if not fast_bfloat16(torch.device("cpu")):
        pytest.skip("no oneDNN bf16 kernel on this CPU (no AMX or AVX512-BF16)")
    if amx and not native.bf16_usable(960, 576):
        pytest.skip("the native bf16 kernels do not run here (no AVX2, or no compiler)")
    if not amx:
        monkeypatch.setattr(native, "bf16_usable", lambda out_features, in_features: False)
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(576, 960, bias=False)
    linear.weight.data = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    packed = PackedLinear(linear)
    assert packed.kind == (("amx" if native.amx() else "dot") if amx else "onednn")
    x = torch.randn(8, 5, 576, generator=gen).bfloat16()  # a batch of 8 verify rows of 5 tokens
    with torch.no_grad():
        single = torch.stack([torch.cat([packed(x[b, t][None]) for t in range(5)]) for b in range(8)])
        assert torch.equal(packed(x), single)


def test_huge_pages_leave_onednn_packed_weights_where_they_are():
    # Without the native kernels a bf16 lm_head is prepacked by oneDNN (an opaque tensor, no storage):
    # loading the bundled int4 model that way raised NotImplementedError here.
    from speculant.models.hugepages import huge_pages_available, move_to_huge_pages

    if not huge_pages_available():
        pytest.skip("no transparent huge pages here (not Linux, or THP set to never)")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    module = torch.nn.Module()
    module.plain = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    module.register_buffer("packed", torch.randn(64, 64).to_mkldnn())
    packed = module.packed
    assert move_to_huge_pages(module) == 64 * 64 * 4
    assert module.packed is packed


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_weights_moved_to_huge_pages_compute_the_same_and_stay_tied(tmp_path, monkeypatch, quantization):
    from speculant.models.hugepages import PAGE, SWITCH_ENV, huge_pages_available, move_to_huge_pages

    if not huge_pages_available():
        pytest.skip("no transparent huge pages here (not Linux, or THP set to never)")
    folder = save_tiny(tmp_path, hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    loaded = load_model(folder, dtype="bfloat16", quantization=quantization)
    assert loaded.load_info["huge_pages_bytes"] > 0  # moved at load
    monkeypatch.setenv(SWITCH_ENV, "off")
    assert load_model(folder, dtype="bfloat16", quantization=quantization).load_info["huge_pages_bytes"] == 0
    monkeypatch.delenv(SWITCH_ENV)
    model = load_model(folder, dtype="bfloat16", quantization=quantization, pack=False).model  # not moved
    assert "huge_pages_bytes" not in load_model(folder, pack=False).load_info
    tokens = torch.tensor([[5, 9, 31, 7, 2, 60]])

    def logits():
        cache = model.new_cache(1, 16)
        with torch.no_grad():
            return model.logits(model(tokens, cache, torch.tensor([0])))

    def addresses() -> dict[str, int]:
        return {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}

    before, old = logits(), addresses()
    moved = move_to_huge_pages(model)
    new = addresses()
    changed = [name for name in new if new[name] != old[name]]
    first = min(new[name] for name in changed)  # one region, from a 2 MB boundary
    assert first % PAGE == 0 and all(first <= new[name] < first + moved for name in changed)
    assert "model.embed_tokens.weight" in changed and any("layers.1." in name for name in changed)
    if quantization == "none":  # tied: the embedding and the lm_head are one tensor, moved once
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(), before)


def test_cache_lengths_set_alike_through_numpy_and_torch():
    """On CPU a row's length is set through a numpy view of the cache's tensor, elsewhere by indexing it:
    the native pass reads the tensor either way."""
    host, indexed = (KVCache(1, 4, 1, 8, 32, torch.float32, "cpu") for _ in range(2))
    indexed._host_lengths = None  # the path a CUDA cache takes
    for cache in (host, indexed):
        cache.set_lengths([2, 0], [5, 3])
        cache.rollback(2, 1)
    assert host.lengths.tolist() == indexed.lengths.tolist() == [3, 0, 1, 0]


def test_a_file_read_into_huge_pages_in_the_background(tmp_path, monkeypatch):
    """The packed cache is copied by a thread while the model is built: wait() gives the file's bytes, or the
    copy's error (a file cut short) where it failed."""
    from speculant.models import hugepages

    if not hugepages.huge_pages_available():
        pytest.skip("no transparent huge pages here (not Linux, or THP set to never)")
    data = torch.randint(0, 256, (3 * 2**20 + 17,), dtype=torch.uint8)
    path = tmp_path / "packed.bin"
    path.write_bytes(data.numpy().tobytes())
    reading = hugepages.start_reading(path)
    assert torch.equal(reading.wait(), data)
    region = hugepages.huge_page_region
    monkeypatch.setattr(hugepages, "huge_page_region", lambda n: region(n + 100))  # more than the file holds
    with pytest.raises(OSError, match="ended after"):
        hugepages.start_reading(path).wait()
