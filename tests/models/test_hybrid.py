"""Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet beside gated attention, models/gdn.py) against
transformers; every speculation path on them equals plain greedy decoding (alone, a batch of 3 whose rows accept
different lengths, chunked prefill, a prefix-cache hit, zero drafts after accepted ones); the rollback mutants
are caught; the checkpoint's MTP layer drafts (proposers/mtp.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import greedy_tokens, reference_greedy_tokens, save_tiny, transformers
from mutants import STATE_MUTANTS, patch_state_rollback
from safetensors.torch import load_file, save_file

from speculant.config import SamplingParams, SpeculativeConfig
from speculant.errors import SpeculantError
from speculant.llm import engine_for
from speculant.models.loader import load_model
from speculant.models.state_cache import HybridCache

VOCAB = 256
N_TOKENS = 24
TOL = 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              num_hidden_layers=4, init_std=0.1, tie_word_embeddings=False)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, dict(COMMON, intermediate_size=96)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, dict(COMMON, **MOE)),
    # Layer 1 dense (mlp_only_layers); the DeltaNet projections stored grouped per key head.
    "qwen3_next": (transformers.Qwen3NextConfig, dict(COMMON, intermediate_size=96, mlp_only_layers=[1], **MOE)),
}
# Repeats for prompt lookup, and rows of different lengths.
PROMPTS = [[5, 17, 33, 8, 60, 12], [40, 41, 42, 40, 41, 42, 40], [90, 3, 77, 21, 14, 9, 55, 31, 62, 90, 3, 77]]
LONG = [3, 50, 99, 140, 7, 64, 230, 18, 120, 45, 71, 9, 188, 33, 250, 101]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    config_cls, overrides = FAMILIES[request.param]
    folder = save_tiny(tmp_path_factory.mktemp(request.param) / "hf", config_cls, seed=3, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, ref, folder


def add_mtp_layer(folder, seed: int = 11) -> None:
    """The MTP tensors a Qwen3.5 checkpoint carries (mtp.fc, its norms, one full-attention layer, mtp.norm), random
    but near the model's own last layer, and `mtp_num_hidden_layers: 1` as published configs state it."""
    import json

    state = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    dim = state["model.embed_tokens.weight"].shape[1]
    last = max(int(k.split(".")[2]) for k in state if k.startswith("model.layers.") and ".self_attn." in k)
    for key, w in list(state.items()):
        if key.startswith(f"model.layers.{last}."):
            state["mtp.layers.0." + key.split(".", 3)[3]] = w + 0.02 * torch.randn(w.shape, generator=gen)
    eye = torch.cat((0.1 * torch.randn(dim, dim, generator=gen), torch.eye(dim)), dim=1)  # mostly the hidden state
    state |= {"mtp.fc.weight": eye, "mtp.norm.weight": torch.zeros(dim),
              "mtp.pre_fc_norm_embedding.weight": torch.zeros(dim), "mtp.pre_fc_norm_hidden.weight": torch.zeros(dim)}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5 target with an MTP layer, and a smaller Qwen3.5 draft (hybrid too) of its vocabulary."""
    root = tmp_path_factory.mktemp("hybrid")
    config_cls, overrides = FAMILIES["qwen3_5"]
    target = save_tiny(root / "target", config_cls, seed=3, **overrides)
    add_mtp_layer(target)
    draft = save_tiny(root / "draft", config_cls, seed=5, **dict(overrides, intermediate_size=48))
    return load_model(target), draft


greedy = functools.partial(greedy_tokens, n_tokens=N_TOKENS)


reference_greedy = functools.partial(reference_greedy_tokens, n_tokens=N_TOKENS)


def test_folder_logits_and_greedy_tokens_equal_transformers(family):
    """A prompt pass, decode steps and a 3-token pass against transformers' forward; greedy tokens against its
    generate (chunked prefill and recurrent decoding there, our recurrence everywhere)."""
    name, ref, folder = family
    target = load_model(folder)
    model, ids = target.model, torch.tensor([LONG])
    assert isinstance(model.new_cache(1, 8), HybridCache)
    with torch.no_grad():
        expected = ref(ids).logits
        cache, slot, n = model.new_cache(1, 64), torch.tensor([0]), len(LONG)
        got = [model.logits(model(ids[:, :n - 6], cache, slot))]
        got += [model.logits(model(ids[:, t:t + 1], cache, slot)) for t in range(n - 6, n - 3)]
        got += [model.logits(model(ids[:, n - 3:], cache, slot))]
    err = (torch.cat(got, dim=1) - expected).abs().max().item()
    print(f"{name}: max |Δlogits| {err:.2e}")
    assert err <= TOL
    assert greedy(target, PROMPTS) == [reference_greedy(ref, p) for p in PROMPTS]


def specs(draft) -> list[dict]:
    return [{"method": "ngram", "num_speculative_tokens": 4},
            {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1},
            {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft)},
            {"method": "mtp", "num_speculative_tokens": 3},
            {"method": "qwen3_next_mtp", "num_speculative_tokens": 2, "lookup_first": True},
            {"method": "mtp", "num_speculative_tokens": 4, "adaptive": True}]


def test_every_proposer_alone_and_in_a_batch_equals_plain_greedy(hybrid):
    """Each prompt alone and the three as one batch: their rows accept different lengths, and lookup rows draft
    nothing on some steps after steps that accepted drafts."""
    target, draft = hybrid
    plain = greedy(target, PROMPTS)
    assert greedy(target, PROMPTS, max_batch_size=3) == plain
    for spec in specs(draft):
        assert greedy(target, PROMPTS, spec) == plain, spec
        assert greedy(target, PROMPTS, spec, max_batch_size=3) == plain, spec


def test_chunked_prefill_equals_plain_greedy(hybrid):
    """Prompts fed 3 or 5 tokens a pass, alone and riding a batch's decode passes: the state follows the tokens,
    not the cut."""
    target, draft = hybrid
    prompts = [LONG + p for p in PROMPTS]
    plain = greedy(target, prompts, prefill_chunk=0)
    for chunk in (3, 5):
        assert greedy(target, prompts, prefill_chunk=chunk) == plain
        assert greedy(target, prompts, specs(draft)[2], max_batch_size=3, prefill_chunk=chunk) == plain
        assert greedy(target, prompts, specs(draft)[3], max_batch_size=3, prefill_chunk=chunk) == plain


def test_a_prefix_cache_hit_starts_from_a_stored_state_and_equals_plain(hybrid):
    """A conversation's second turn starts from the state stored at the first turn's prompt end (a boundary with
    a state), never from a guess: its tokens are plain decoding's, with lookup drafting too."""
    target, _ = hybrid
    first = LONG
    for spec in (None, specs(None)[0]):
        e = engine_for(target, SpeculativeConfig.parse(spec), 2, 128, prefix_cache_bytes=1 << 24)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        e.generate([e.add_request(first, params)])
        second = first[:-1] + [7, 7, 9, 7, 7, 9, 31]  # shares the first prompt's state boundary (its end)
        seq = e.generate([e.add_request(second, params)])[0]
        assert seq.cached_tokens == len(first) - 1
        assert seq.output_ids == greedy(target, [second])[0][:8]


def test_draft_trees_are_refused_with_one_line(hybrid):
    target, draft = hybrid
    with pytest.raises(SpeculantError, match="recurrent state per node.*chains"):
        engine_for(target, SpeculativeConfig.parse({"method": "draft_model", "model": str(draft),
                                                    "num_speculative_tokens": 3, "tree_width": 2}), 1, 64)


def test_mtp_on_a_model_without_mtp_tensors_is_one_line(tiny_pair, family):
    for folder in (tiny_pair[0], family[2]):
        with pytest.raises(SpeculantError, match="carries no multi-token-prediction layer") as e:
            engine_for(load_model(folder), SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}),
                       1, 64)
        assert "\n" not in str(e.value)


def test_mtp_layer_equals_transformers_decoder_layer(hybrid, tmp_path):
    """The MTP head's logits against the same formula built from transformers' own Qwen3.5 decoder layer, norms
    and rotary embedding over the target's final hidden states: fc([norm(embed(x_{t+1})), norm(h_t)]) → the
    layer (positions from 0, causal) → norm → lm_head."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from speculant.proposers.mtp import load_mtp, mtp_tensors

    target, _ = hybrid
    folder = target.source
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = ref.config
    state = {k.removeprefix("mtp."): v for k, v in mtp_tensors(target).items()}
    layer = hf.Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")})
    norms = {name: hf.Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps) for name in
             ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    for name, norm in norms.items():
        norm.weight.data.copy_(state[f"{name}.weight"])
    ids = torch.tensor([LONG])
    T = len(LONG) - 1
    with torch.no_grad():
        hidden = ref.model(ids).last_hidden_state[:, :T]  # post-norm, as the MTP layer reads it
        embeds = ref.model.embed_tokens(ids[:, 1:])
        x = torch.cat((norms["pre_fc_norm_embedding"](embeds), norms["pre_fc_norm_hidden"](hidden)), dim=-1)
        x = x @ state["fc.weight"].t()
        positions = torch.arange(T)[None]
        rope = hf.Qwen3_5TextRotaryEmbedding(config)(x, positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        expected = ref.lm_head(norms["norm"](layer(x, rope, attention_mask=mask, position_ids=positions)))
        head = load_mtp(target)
        model = target.model
        cache = head.new_cache(1, 32)
        features = model(ids[:, :T], model.new_cache(1, 32), torch.tensor([0]))
        got = model.logits(head(model.embed(ids[:, 1:]), features, cache, torch.tensor([0])))
    err = (got - expected).abs().max().item()
    print(f"MTP head: max |Δlogits| {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("mutant", STATE_MUTANTS)
def test_a_wrong_rollback_is_caught(hybrid, mutant, monkeypatch):
    target, draft = hybrid
    plain = greedy(target, PROMPTS)
    patch_state_rollback(mutant, monkeypatch)
    runs = [greedy(target, PROMPTS, spec, max_batch_size=3) for spec in specs(draft)[:4]]
    assert any(run != plain for run in runs), mutant


@pytest.fixture(scope="module")
def small_hybrid(tmp_path_factory):
    """A Qwen3.5 of vocabulary 8 with large weights and an MTP layer, and a hybrid draft: peaked, different
    distributions, so a wrong rule shows in a few thousand samples."""
    root = tmp_path_factory.mktemp("small_hybrid")
    small = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                 linear_value_head_dim=8, num_hidden_layers=4, init_std=0.3, tie_word_embeddings=False)
    target = save_tiny(root / "target", transformers.Qwen3_5TextConfig, seed=3, **small)
    add_mtp_layer(target)
    draft = save_tiny(root / "draft", transformers.Qwen3_5TextConfig, seed=4, **small)
    return load_model(target), load_model(draft)


@pytest.mark.usefixtures("rule_path")  # seeded rows judged by the acceptance rule, as unseeded ones
@pytest.mark.parametrize("method", ["draft_model", "mtp", "ngram"])
def test_sampled_speculation_follows_the_target_distribution(small_hybrid, method):
    """The joint law of three sampled tokens against the target's, by a G-test at ALPHA (test_distribution.py):
    each method's rollback and acceptance on the hybrid model, rows of one batch accepting different lengths."""
    from test_distribution import ALPHA, BATCH, N_SAMPLES, N_TOKENS, exact_joint, g_test, sampled_joint

    from speculant.engine import Engine
    from speculant.proposers import build_proposer

    target, draft = small_hybrid
    spec = {"draft_model": {"method": "draft_model", "model": draft.source}, "mtp": {"method": "mtp"},
            "ngram": {"method": "ngram", "prompt_lookup_min": 1}}[method]
    cfg = SpeculativeConfig.parse({**spec, "num_speculative_tokens": 2})
    engine = Engine(target, build_proposer(cfg, target, BATCH, 64), 2, max_batch_size=BATCH, max_model_len=32)
    params = SamplingParams(temperature=1.0)
    p = g_test(sampled_joint(engine, params, N_SAMPLES), exact_joint(target.model, params, N_TOKENS))
    stats = engine.stats
    print(f"{method}: G-test p = {p:.4f}, accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens}")
    assert p > ALPHA and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_states_do_not_depend_on_its_batch_or_its_pass(tmp_path, dtype):
    """Bitwise, at a published head size (dk = dv = 128): a row's hidden states fed in a batch of 3 beside rows
    of other lengths, or one token a pass, equal the row's alone in one pass (the recurrence's sums run in one
    order whatever the pass holds)."""
    config_cls, overrides = FAMILIES["qwen3_5"]
    folder = save_tiny(tmp_path / "wide", config_cls, seed=2, **dict(
        overrides, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_value_heads=4))
    model = load_model(folder, dtype=dtype).model
    rows = [LONG[:9], LONG, LONG[3:12]]
    with torch.no_grad():
        alone = model(torch.tensor([LONG]), model.new_cache(1, 32), torch.tensor([0]))[0]
        cache = model.new_cache(3, 32)
        tokens = torch.tensor([r + [0] * (len(LONG) - len(r)) for r in rows])
        batch = model(tokens, cache, torch.arange(3), torch.tensor([len(r) for r in rows]))[1]
        cache = model.new_cache(1, 32)
        steps = torch.cat([model(torch.tensor([[t]]), cache, torch.tensor([0]))[0] for t in LONG])
    assert torch.equal(batch, alone) and torch.equal(steps, alone)
