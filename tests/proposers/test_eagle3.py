"""EAGLE-3 heads: three config dialects, one loader; the fused-layer convention; lossless chains and trees in fp32,
bf16 and int4; heads that do not fit the target refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny, transformers
from test_seed_configs import with_tokenizer

from speculant.cli import main
from speculant.config import SamplingParams, SpeculativeConfig
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers import build_proposer
from speculant.proposers.eagle3 import DIALECTS, Eagle3Proposer, head_from_target, load_eagle3, save_eagle3

N_LAYERS = 5
AUX = [1, 3, N_LAYERS]  # the embeddings' next layer, a middle one, the last layer's output before the final norm
DRAFT_VOCAB = torch.tensor(sorted({0, 1, 2} | set(range(3, 96, 3))))  # 34 of the 96 tokens
PROMPTS = [[1, 5, 9, 14], [1, 33, 2, 7, 7, 7, 7, 40, 41], [1, 60], [3, 4, 5, 3, 4, 5, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return with_tokenizer(save_tiny(tmp_path_factory.mktemp("e3") / "target", seed=0, num_hidden_layers=N_LAYERS))


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
    """Heads of 64 dims: the bf16 passes run on the native stack (decode, packed rows, prepared) where built."""
    return save_tiny(tmp_path_factory.mktemp("e3n") / "target", seed=2, num_hidden_layers=N_LAYERS, hidden_size=128,
                     intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


def random_head(target, aux=AUX, vocab=DRAFT_VOCAB, std: float = 0.3, seed: int = 0, **flags):
    torch.manual_seed(seed)
    head = head_from_target(target.config, aux, vocab, **flags)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
        elif "norm" in name:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """One random head (EAGLE 3.1's norms on) saved in each dialect."""
    head = random_head(target, norm_before_fc=True, fc_norm=True, norm_before_residual=True)
    root = tmp_path_factory.mktemp("heads")
    for dialect in DIALECTS:
        save_eagle3(head, root / dialect, dialect, dtype=torch.float32)
    return {d: root / d for d in DIALECTS}


def engine_for(target, head, k: int, batch: int = 3, tree_width: int = 1, max_len: int = 64) -> Engine:
    proposer = Eagle3Proposer(head, target.model, batch, max_len + k + tree_width, tree_width, k)
    return Engine(target, proposer, k, max_batch_size=batch, max_model_len=max_len)


def run(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [s.output_ids for s in engine.generate([engine.add_request(p, params) for p in prompts])]


def recorded_drafts(engine: Engine) -> list:
    drafts = []
    original = engine.proposer.propose

    def spy(seqs, ks, sb):
        out = original(seqs, ks, sb)
        drafts.append([(s.request_id, out.tokens[b, :int(out.n_draft[b])].tolist()) for b, s in enumerate(seqs)])
        return out

    engine.proposer.propose = spy
    return drafts


def plain(target, prompts=PROMPTS, params=GREEDY, batch: int = 3) -> list[list[int]]:
    return run(Engine(target, max_batch_size=batch, max_model_len=64), prompts, params)


# -- dialects ------------------------------------------------------------------------------------


def test_three_dialects_load_one_head_and_draft_the_same_tokens(target, heads):
    configs = {d: json.loads((heads[d] / "config.json").read_text()) for d in DIALECTS}
    assert configs["speculators"]["transformer_layer_config"]["hidden_size"] == 64
    assert configs["speculators"]["target_hidden_size"] is None
    assert "eagle_config" in configs["modelopt"] and "use_aux_hidden_state" in configs["modelopt"]["eagle_config"]
    assert configs["specforge"]["architectures"] == ["LlamaForCausalLMEagle3"]
    loaded = {d: load_eagle3(heads[d], target) for d in DIALECTS}
    states = {d: {k: v for k, v in h.state_dict().items()} for d, h in loaded.items()}
    for d in DIALECTS[1:]:
        assert states[d].keys() == states["specforge"].keys()
        assert all(torch.equal(states[d][k], states["specforge"][k]) for k in states[d])
    drafted = {}
    for d, head in loaded.items():
        engine = engine_for(target, head, 3)
        drafts = recorded_drafts(engine)
        run(engine)
        drafted[d] = drafts
    assert drafted["speculators"] == drafted["specforge"] == drafted["modelopt"]
    assert sum(len(t) for step in drafted["specforge"] for _, t in step) > 20


def test_published_tensor_names_load(target, heads, tmp_path):
    """vLLM's `layers.0.` and a `model.` prefix both name the head's layer; q/k/v and gate/up come split."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(heads["specforge"] / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in state and "midlayer.mlp.gate_proj.weight" in state
    folder = tmp_path / "prefixed"
    folder.mkdir()
    save_file({f"model.{k}": v for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((heads["specforge"] / "config.json").read_text())
    a, b = load_eagle3(folder, target), load_eagle3(heads["specforge"], target)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- lossless --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, tree_width", [(1, 1), (3, 1), (5, 1), (3, 2), (4, 3)])
def test_greedy_output_is_plain_greedy(target, heads, k, tree_width):
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": str(heads["speculators"]),
                                    "num_speculative_tokens": k, "tree_width": tree_width})
    engine = Engine(target, build_proposer(spec, target, 3, 64 + k + tree_width), k, max_batch_size=3,
                    max_model_len=64)
    assert engine.proposer.name == spec.proposer
    assert run(engine) == plain(target)
    assert engine.stats.num_draft_tokens > 0


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int4")])
def test_greedy_is_plain_and_batch_invariant(native_dir, tmp_path, dtype, quantization):
    """fp32, bf16 and int4 targets (bf16 on the native stack where built): greedy output is plain greedy, and each
    row's drafts are the same alone as in a batch (the head's kernels compute each row on its own)."""
    target = load_model(native_dir, dtype=dtype, quantization=quantization)
    save_eagle3(random_head(load_model(native_dir), std=0.1), tmp_path / "head", dtype=torch.float32)
    head = load_eagle3(tmp_path / "head", target)
    prompts = PROMPTS[:3]
    for tree_width in (1, 2):
        batched = engine_for(target, head, 3, batch=3, tree_width=tree_width)
        batched_drafts = recorded_drafts(batched)
        assert run(batched, prompts) == plain(target, prompts)
        alone = []
        for p in prompts:
            engine = engine_for(target, head, 3, batch=1, tree_width=tree_width)
            alone.append([d for step in recorded_drafts_of(engine, p) for _, d in step])
        by_row = [[d for step in batched_drafts for rid, d in step if rid == f"req-{i}"] for i in range(len(prompts))]
        assert by_row == alone


def recorded_drafts_of(engine: Engine, prompt: list[int]) -> list:
    drafts = recorded_drafts(engine)
    run(engine, [prompt])
    return drafts


# -- the fused-layer convention ------------------------------------------------------------------


def reference_first_drafts(target_dir, head, tokens: list[int], aux) -> int:
    """The head's first draft after `tokens`, from transformers' own hidden states: output_hidden_states[i] is
    the input of layer i (i = N: the last layer's output, before the final norm)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        states = list(out.hidden_states)
        states[-1] = pre_norm_output(hf, tokens[:-1])
        features = torch.cat([states[i] for i in aux], dim=-1)
        embeds = hf.model.embed_tokens(torch.tensor([tokens[1:]]))
        pred = head(embeds, features, head.new_cache(1, len(tokens)), torch.tensor([0]))[:, -1:]
        draft = int(head.logits(pred).argmax(-1))
    return draft + int(head.d2t[draft])


def pre_norm_output(hf, tokens: list[int]) -> torch.Tensor:
    """The last layer's output before the final norm (transformers' hidden_states[-1] is after it)."""
    kept = {}
    handle = hf.model.norm.register_forward_hook(lambda _m, args, _out: kept.setdefault("x", args[0]))
    hf(torch.tensor([tokens]))
    handle.remove()
    return kept["x"]


class ShiftedCapture(Eagle3Proposer):
    """Reads each fused layer's output instead of its input (the other convention in circulation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture = tuple(min(i + 1, N_LAYERS) for i in self.capture)


class AbsoluteD2T(Eagle3Proposer):
    """Reads d2t as absolute target ids (llama.cpp's converter's form), not offsets."""

    def draw_from_vocab(self, logits, sb):
        token, q = self.draw(logits, sb)
        return self.head.d2t[token], q


@pytest.mark.parametrize("proposer_cls, right", [(Eagle3Proposer, True), (ShiftedCapture, False),
                                                 (AbsoluteD2T, False)])
def test_first_drafts_follow_transformers_hidden_states(target_dir, target, proposer_cls, right):
    """Every first draft equals the head's prediction from transformers' output_hidden_states at the configured
    ids; a proposer reading other layers, or d2t as absolute ids, is caught."""
    head = random_head(target, vocab=torch.arange(0, 96, 2))  # offsets d2t[i] = i: absolute ids differ
    engine = Engine(target, proposer_cls(head, target.model, 1, 64 + 4, 1, 3), 3, max_batch_size=1, max_model_len=64)
    checked = []
    original = engine.proposer.propose

    def spy(seqs, ks, sb):
        out = original(seqs, ks, sb)
        tokens = seqs[0].tokens
        if out.n_draft[0] and len(tokens) > 1:
            checked.append(reference_first_drafts(target_dir, head, tokens, AUX) == int(out.tokens[0, 0]))
        return out

    engine.proposer.propose = spy
    run(engine, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(checked) >= 3
    assert all(checked) if right else not all(checked)


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int4")])
def test_capture_keeps_the_pass_bits_on_every_path(native_dir, dtype, quantization):
    """forward(capture=…) returns the plain pass's hidden states bit for bit and, near enough, the layer inputs the
    fp32 module path computes: fp32 and bf16 modules, and int4 on the native stack where built (decode, packed)."""
    from speculant.models import native

    model = load_model(native_dir, dtype=dtype, quantization=quantization).model
    if quantization and native.attention_usable(64) and native.quantized_usable(128, 128):
        assert model.native_stack is not None and model.packs_ragged  # int4's kernels: AVX512 alone
    ref = load_model(native_dir).model
    ids = (0, 2, N_LAYERS)
    tokens = torch.tensor([[1, 5, 9, 14, 20, 30], [1, 7, 8, 0, 0, 0]])
    for n in (None, torch.tensor([6, 3]), torch.tensor([1, 1])):
        t = tokens if n is None or int(n.max()) > 1 else tokens[:, :1]
        plain_hidden = model(t, model.new_cache(2, 16), torch.tensor([0, 1]), n)
        hidden, features = model(t, model.new_cache(2, 16), torch.tensor([0, 1]), n, capture=ids)
        assert torch.equal(hidden, plain_hidden)
        assert features.shape == (2, t.shape[1], 3 * 128)
        _, exact = ref(t, ref.new_cache(2, 16), torch.tensor([0, 1]), n, capture=ids)
        real = [t.shape[1], t.shape[1] if n is None else int(n[1])]
        for b in range(2):
            assert torch.equal(features[b, :real[b], :128], model.embed(t)[b, :real[b]])
            torch.testing.assert_close(features[b, :real[b]].float(), exact[b, :real[b]], rtol=0.1, atol=0.1)


# -- refused heads ---------------------------------------------------------------------------------


def edited(folder, tmp_path, name: str, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    out = tmp_path / name
    out.mkdir()
    raw = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config(raw) if config else raw))
    state = load_file(str(folder / "model.safetensors"))
    save_file(tensors(state) if tensors else state, str(out / "model.safetensors"))
    return out


def with_aux(raw, ids):
    raw["eagle_aux_hidden_state_layer_ids"] = ids
    return raw


def with_vocab(raw):
    raw["transformer_layer_config"]["vocab_size"] = 128
    return raw


def shifted_d2t(state):
    state["d2t"] = state["d2t"] + 200
    return state


@pytest.mark.parametrize("name, config, tensors, why", [
    ("aux", lambda raw: with_aux(raw, [1, 3, N_LAYERS + 1]), None, "fused layers"),
    ("aux2", lambda raw: with_aux(raw, [1, 3]), None, "fc.weight"),
    ("vocab", with_vocab, None, "vocabulary has 128 tokens"),
    ("d2t", None, shifted_d2t, "d2t offsets map draft ids outside"),
])
def test_a_head_that_does_not_fit_is_refused_in_one_line(target, target_dir, heads, tmp_path, capsys, name, config,
                                                         tensors, why):
    folder = edited(heads["speculators"], tmp_path, name, config, tensors)
    with pytest.raises(SpeculantError, match=why) as e:
        load_eagle3(folder, target)
    assert "\n" not in str(e.value) and "does not fit the target 'target'" in str(e.value)
    rc = main(["generate", "x", "--no-chat", "--model", str(target_dir), "--speculative-config",
               json.dumps({"method": "eagle3", "model": str(folder), "num_speculative_tokens": 2})])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and why in lines[0], lines


def test_eagle3_without_a_model_is_one_line():
    with pytest.raises(SpeculantError, match="method 'eagle3' needs \"model\": the EAGLE-3 head's folder"):
        SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 2})


def test_default_fused_layers_are_vllms(target, heads, tmp_path):
    """No ids in the config: (2, N//2, N-3), read as the hidden states entering those layers."""

    def without_ids(raw):
        del raw["eagle_aux_hidden_state_layer_ids"]
        return raw

    folder = edited(heads["speculators"], tmp_path, "default", without_ids)
    assert load_eagle3(folder, target).aux_layers == (2, N_LAYERS // 2, N_LAYERS - 3)


def peers_capture(config: dict) -> dict[str, list[int]]:
    """The layers each peer's loader feeds a saved head, as inputs of layers (this module's ids): vLLM reads the
    top-level ids as layer inputs, SGLang eagle_config's as layer outputs and captures id + 1."""
    seen = {}
    if "eagle_aux_hidden_state_layer_ids" in config:
        seen["vllm"] = config["eagle_aux_hidden_state_layer_ids"]
    if "eagle_aux_hidden_state_layer_ids" in config.get("eagle_config", {}):
        seen["sglang"] = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return seen


@pytest.mark.parametrize("mutant", [False, True])
def test_each_dialect_keeps_its_own_layer_convention(target, tmp_path, monkeypatch, mutant):
    """A head written in each dialect reads back, here and in vLLM and SGLang, the layers it was trained on; a
    config of SGLang's own (ids only in eagle_config, layer outputs) reads them too. The mutant (one convention
    for both keys) still round-trips here: only the peers' readings catch it."""
    from speculant.proposers import eagle3

    if mutant:
        monkeypatch.setattr(eagle3, "to_layer_outputs", list)
        monkeypatch.setattr(eagle3, "from_layer_outputs", list)
    head = random_head(target)
    right = {"vllm": [], "sglang": []}  # does each peer's reading of each saved head feed it the layers AUX?
    for dialect in DIALECTS:
        save_eagle3(head, tmp_path / dialect, dialect, dtype=torch.float32)
        seen = peers_capture(json.loads((tmp_path / dialect / "config.json").read_text()))
        assert seen.keys() == {"speculators": {"vllm"}, "modelopt": {"sglang"}, "specforge": {"vllm", "sglang"}}[
            dialect]
        assert load_eagle3(tmp_path / dialect, target).aux_layers == tuple(AUX)
        for peer, ids in seen.items():
            right[peer].append(ids == AUX)
    sglang = edited(tmp_path / "specforge", tmp_path, "sglang_own",
                    lambda raw: {**raw, "eagle_aux_hidden_state_layer_ids": None,
                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, N_LAYERS - 1]}})
    right["sglang"].append(load_eagle3(sglang, target).aux_layers == tuple(AUX))
    assert right["vllm"] == [True, True]
    assert right["sglang"] == [not mutant] * 3


def test_recomputed_features_give_the_scratch_row_back(target):
    """Features the head's cache lacks are recomputed in a scratch row of the target's: its pages go back after
    the pass (they read as zeros), and requests one after another leave every row free."""
    head = random_head(target)
    prompt = [3 + i % 90 for i in range(400)]
    proposer = Eagle3Proposer(head, target.model, 1, 500 + 4, 1, 3)
    engine = Engine(target, proposer, 3, max_batch_size=1, max_model_len=500, prefix_cache_bytes=1 << 26)
    proposer.prefix_cache.store = lambda *args: None  # the head keeps nothing: every shared prefix is recomputed
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for tail in range(3):
        run(engine, [prompt + [tail + 3]], params)
    assert proposer.scratch is not None and engine.prefix_cache.stats.hits >= 2
    assert not proposer.scratch.k[:, 0, :, 64:380].any() and not proposer.scratch.v[:, 0, :, 64:380].any()
    assert proposer.free == [0] and not proposer.slot


# -- prefix caching ----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_cache", ["kept", "lost"])
def test_prefix_cache_stays_on_and_drafts_are_unchanged(target, heads, head_cache):
    """Requests sharing prompts, one after another: the target loads cached keys, the head its cached entries
    ("lost": the head keeps none, and the features it lacks are recomputed); every draft and every output token
    are those of an engine without the cache."""
    head = load_eagle3(heads["specforge"], target)
    prompts = [PROMPTS[1], PROMPTS[1] + [50, 51], PROMPTS[1][:6] + [9], PROMPTS[1] + [50, 51, 52, 53]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def one_by_one(cache_bytes: int):
        proposer = Eagle3Proposer(head, target.model, 1, 64 + 4, 1, 3)
        engine = Engine(target, proposer, 3, max_batch_size=1, max_model_len=64, prefix_cache_bytes=cache_bytes)
        if cache_bytes and head_cache == "lost":
            proposer.prefix_cache.store = lambda *args: None
        drafts = recorded_drafts(engine)
        outs = [run(engine, [p], params)[0] for p in prompts]
        return outs, [[d for _, d in step] for step in drafts], engine

    expected, expected_drafts, _ = one_by_one(0)
    got, got_drafts, engine = one_by_one(1 << 24)
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.hits > 0
    assert got == expected and got_drafts == expected_drafts
    assert plain(target, prompts, params, batch=1) == expected


# -- sampled ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("rule_path")
@pytest.mark.parametrize("setting", ["t1", "t0.7_topk"])
def test_sampling_matches_the_target_over_a_draft_vocabulary(small_vocab_pair, setting):
    """A head drafting 5 of the 8 tokens (q is 0 on the others, where p is not), sampled: the output's
    distribution is the target's (G-test, as test_eagle's)."""
    from test_distribution import ALPHA, N_SAMPLES, N_TOKENS, SETTINGS, exact_joint, g_test, sampled_joint

    target = load_model(small_vocab_pair[0])
    head = random_head(target, aux=[0, 1, 2], vocab=torch.tensor([0, 2, 3, 5, 6]), std=0.5)
    engine = Engine(target, Eagle3Proposer(head, target.model, 400, 64, 1, 2), 2, max_batch_size=400,
                    max_model_len=32)
    p = g_test(sampled_joint(engine, SETTINGS[setting], N_SAMPLES), exact_joint(target.model, SETTINGS[setting],
                                                                               N_TOKENS))
    assert engine.stats.num_accepted_tokens > 0
    assert p > ALPHA
