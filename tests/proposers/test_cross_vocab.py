"""A draft of another tokenizer (cross_vocab.py): greedy output is plain greedy's by TLI and by string level,
alone and in a batch; the id map pairs equal strings; the draft reads the target's text whatever the tokens'
boundaries; seeded requests write plain decoding's tokens; a draft sharing almost nothing is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny
from vocab_pairs import CORPUS_A, CORPUS_B, byte_level, save_tokenizer, sibling, with_weights_of

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.errors import SpeculantError
from speculant.llm import LLM
from speculant.models.loader import load_model
from speculant.proposers.cross_vocab import CrossVocabProposer
from speculant.proposers.retokenize import DraftText, TextBridge, TextCodec, utf8_runs
from speculant.proposers.vocab_map import BYTE_LEVEL, OTHER, SENTENCEPIECE, VocabMap, build_vocab_map, vocab_map

V = 416  # the models' rows: past the tokenizers' ~360 tokens, padding
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TEXTS = ["the cat sat", "def add(a, b):", "日本語の"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """target; `sibling`: the target's weights under its vocabulary less 20 merges plus 2 of its own, ids
    shuffled; `other`: a random draft whose tokenizer was trained on other text."""
    root = tmp_path_factory.mktemp("cross_vocab")
    t_tok = byte_level(CORPUS_A, 400)
    d_tok, to_target = sibling(t_tok, 20, [("x", "q"), ("q", "x")])
    target = save_tokenizer(save_tiny(root / "target", seed=0, num_hidden_layers=3, vocab_size=V), t_tok)
    twin = save_tokenizer(with_weights_of(target, root / "sibling", to_target, V), d_tok)
    other = save_tokenizer(save_tiny(root / "other", seed=1, num_hidden_layers=1, hidden_size=32,
                                     intermediate_size=64, vocab_size=V), byte_level(CORPUS_B, 400))
    return {"target": target, "sibling": twin, "other": other, "to_target": to_target}


@pytest.fixture(scope="module")
def models(paths):
    return {name: load_model(paths[name]) for name in ("target", "sibling", "other")}


def run(target, proposer, prompts, params=GREEDY, k=4, batch=3):
    engine = Engine(target, proposer, k if proposer else 0, max_batch_size=batch, max_model_len=128)
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.generate(seqs)
    return [s.output_ids for s in seqs], engine.stats


def proposer(models, draft: str, mapping: str | None = None, batch: int = 3, **rules):
    target, d = models["target"], models[draft]
    vmap = build_vocab_map(target.tokenizer.hf, d.tokenizer.hf, V, V)
    return CrossVocabProposer(d, target, vmap, batch, 128 + 5, mapping=mapping, **rules)


@pytest.fixture(scope="module")
def prompts(models):
    return [models["target"].tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(models, prompts):
    return run(models["target"], None, prompts)[0]


def test_the_map_pairs_tokens_of_one_string(models, paths, tmp_path, monkeypatch):
    target, twin = models["target"].tokenizer.hf, models["sibling"].tokenizer.hf
    vmap = build_vocab_map(target, twin, V, V)
    t_strings = {i: s for s, i in target.get_vocab().items()}
    d_strings = {i: s for s, i in twin.get_vocab().items()}
    assert len(vmap.draft_ids) == len(paths["to_target"]) == vmap.shared
    assert all(d_strings[d] == t_strings[t] for d, t in zip(vmap.draft_ids.tolist(), vmap.target_ids.tolist()))
    assert {d: t for d, t in zip(vmap.draft_ids.tolist(), vmap.target_ids.tolist())} == paths["to_target"]
    assert vmap.target_ids.tolist() == sorted(vmap.target_ids.tolist())
    assert (vmap.draft_kind, vmap.target_kind, vmap.mapping()) == (BYTE_LEVEL, BYTE_LEVEL, "tli")
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    first = vocab_map(target, twin, V, V)
    assert len(list((tmp_path / "vocab_maps").iterdir())) == 1
    again = vocab_map(target, twin, V, V)
    assert torch.equal(again.draft_ids, first.draft_ids) and torch.equal(again.target_ids, first.target_ids)


def test_the_mapping_follows_the_share_and_the_kinds():
    def vmap(shared, d_kind=BYTE_LEVEL, t_kind=BYTE_LEVEL):
        return VocabMap(torch.zeros(0), torch.zeros(0), shared, 1000, 2000, d_kind, t_kind)

    assert vmap(800).mapping() == "tli"
    assert vmap(300).mapping() == "string" and "sampled ones by TLI" in vmap(300).describe()
    assert vmap(800, SENTENCEPIECE).mapping() == "string"
    assert "sampled ones without a draft" in vmap(800, SENTENCEPIECE).describe()
    assert vmap(800, OTHER, OTHER).mapping() == "string"
    assert vmap(20).mapping() == "refuse" and "20 of the draft's 1,000 tokens (2%)" in vmap(20).describe()


@pytest.mark.parametrize("draft", ["sibling", "other"])
@pytest.mark.parametrize("mapping", ["tli", "string"])
def test_greedy_equals_plain(models, prompts, plain, draft, mapping):
    alone = [run(models["target"], proposer(models, draft, mapping, batch=1), [p], batch=1)[0][0] for p in prompts]
    batched, stats = run(models["target"], proposer(models, draft, mapping), prompts)
    assert alone == plain
    assert batched == plain
    assert stats.num_draft_tokens > 0
    if draft == "sibling":  # the target's own weights: its drafts are often right
        assert stats.num_accepted_tokens > 0


def test_greedy_with_the_draft_rules_equals_plain(models, prompts, plain):
    """p_chain and p_min stop drafts from the draft's distributions, and a reduced vocabulary narrows the
    map: the output stays plain greedy's."""
    for rules in ({"p_chain": 0.3}, {"p_min": 0.3}, {"vocab_size": 300}):
        batched, stats = run(models["target"], proposer(models, "sibling", "tli", **rules), prompts)
        assert batched == plain, rules
        assert stats.num_draft_tokens > 0


def test_seeded_requests_write_the_same_tokens_alone_in_a_batch_and_again(models, prompts):
    params = [SamplingParams(temperature=0.9, top_k=40, seed=s, max_tokens=10, ignore_eos=True) for s in (3, 4, 5)]

    def seeded(draft, mapping, rows):
        engine = Engine(models["target"], draft and proposer(models, draft, mapping, batch=3), 4 if draft else 0,
                        max_batch_size=3, max_model_len=128)
        seqs = [engine.add_request(prompts[b], params[b]) for b in rows]
        engine.generate(seqs)
        return [s.output_ids for s in seqs], engine.stats

    plain = seeded(None, None, [0, 1, 2])[0]
    for draft, mapping in (("sibling", "tli"), ("other", "string")):
        batched, stats = seeded(draft, mapping, [0, 1, 2])
        assert [seeded(draft, mapping, [b])[0][0] for b in range(3)] == plain
        assert batched == plain == seeded(draft, mapping, [0, 1, 2])[0]
        assert stats.num_draft_tokens > 0  # string level: the sampled rows draft by TLI (the kinds match)


def test_string_level_drafts_no_sampled_row_without_a_map(models, prompts, plain):
    """Tokenizers of different kinds: greedy rows draft by string level, a sampled row beside them not at all."""
    from dataclasses import replace

    target, other = models["target"], models["other"]
    vmap = replace(build_vocab_map(target.tokenizer.hf, other.tokenizer.hf, V, V), draft_kind=SENTENCEPIECE)
    assert vmap.mapping() == "string"
    engine = Engine(target, CrossVocabProposer(other, target, vmap, 3, 133), 4, max_batch_size=3, max_model_len=128)
    sampled = SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True)
    seqs = [engine.add_request(prompts[0], GREEDY), engine.add_request(prompts[1], sampled),
            engine.add_request(prompts[2], GREEDY)]
    engine.generate(seqs)
    assert [seqs[0].output_ids, seqs[2].output_ids] == [plain[0], plain[2]]
    assert seqs[0].stats.num_draft_tokens > 0 and seqs[1].stats.num_draft_tokens == 0


def test_the_draft_reads_the_target_text_across_split_characters(models):
    """The target's text, fed a token at a time with characters split across byte tokens, is the draft's text
    at every step."""
    t_codec, d_codec = TextCodec(models["target"].tokenizer.hf), TextCodec(models["other"].tokenizer.hf)
    bridge = TextBridge(t_codec, d_codec)
    enc = models["target"].tokenizer.hf.encode
    tokens = (enc("the cat sat caf").ids + [t_codec.byte_id[b] for b in "é".encode()] + enc(" au lait ").ids
              + [t_codec.byte_id[b] for b in "日本".encode()] + enc("語 ok 🙂 x  y\n\tz").ids)
    tokens.insert(1, 1)  # a special token inside the text: <s>, the draft's own
    state = DraftText()
    for n in range(1, len(tokens) + 1):
        bridge.sync(state, tokens[:n])
        assert d_codec.text_of(state.held) == t_codec.text_of(tokens[:n])
    fresh = DraftText()
    bridge.sync(fresh, tokens)
    assert d_codec.text_of(fresh.held) == d_codec.text_of(state.held)
    assert utf8_runs("a日".encode()[:-1]) == [(True, b"a"), (False, "日".encode()[:2])]


def test_string_level_drafts_are_the_draft_text_in_target_tokens(models):
    t_codec, d_codec = TextCodec(models["target"].tokenizer.hf), TextCodec(models["other"].tokenizer.hf)
    bridge = TextBridge(t_codec, d_codec)
    context = models["target"].tokenizer.hf.encode("def add(a, b):\n    ret").ids
    drafted = models["other"].tokenizer.hf.encode("urn a + b 日本").ids
    ids = bridge.target_tokens(context, drafted + [2])  # then </s>: the target's too
    assert t_codec.text_of(ids[:-1]) == "urn a + b 日本".encode() and ids[-1] == 2


def test_the_api_says_how_it_maps_and_refuses_a_draft_sharing_almost_nothing(paths, tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models

    spec = {"method": "draft", "model": str(paths["sibling"]), "num_speculative_tokens": 3}
    llm = LLM(str(paths["target"]), speculative_config=spec)
    assert "token-level intersection (TLI): 338 of the draft's 340 tokens (99%)" in capsys.readouterr().err
    assert llm.engine.k == 3
    words = ["<unk>", "<s>", "</s>"] + [f"qq{i}" for i in range(93)]
    alien = save_tiny(tmp_path / "alien", num_hidden_layers=1)
    save_tokenizer(alien, Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")))
    with pytest.raises(SpeculantError, match=r"shares almost nothing .*: 3 of the draft's 96 tokens \(3%\)"):
        LLM(str(paths["target"]), speculative_config={**spec, "model": str(alien)})


def test_bench_and_advise_note_the_mapping(models, paths):
    from speculant.bench.suite import try_runner
    from speculant.config import SpeculativeConfig

    notes: list[str] = []
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(paths["sibling"]),
                                    "num_speculative_tokens": 2})
    runner = try_runner(models["target"], spec, 1, 64, notes)
    assert runner is not None and runner.method == "draft_model"
    assert notes == ["draft_model: a draft of another vocabulary, mapped by TLI, 99% of the draft's vocabulary "
                     "shared; its acceptance is its row's"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_smollm2_drafts_for_qwen_exactly(smollm_path, name, capsys):
    """Real weights, another tokenizer: Qwen2.5-Coder drafted by the bundled SmolLM2-135M (byte-level BPE both,
    TLI) writes plain greedy's tokens on a chat and a code prompt."""
    from speculant.models.registry import MODELS, is_installed

    if not is_installed(MODELS[name]):
        pytest.skip(f"{name} is not in the cache (speculant models --fetch {name}); not fetched by the tests")
    spec = {"method": "draft", "model": str(smollm_path), "num_speculative_tokens": 4}
    plain_llm = LLM(name, speculative_config=None)
    llm = LLM(name, speculative_config=spec)
    assert "token-level intersection (TLI)" in capsys.readouterr().err
    prompts = ["Explain in two sentences why the sky is blue.",
               "Write a Python function that returns the n-th Fibonacci number."]
    params = SamplingParams(temperature=0, max_tokens=48)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    plain = [o.token_ids for o in plain_llm.chat(chats, params)]
    drafted = [o.token_ids for o in llm.chat(chats, params)]
    assert drafted == plain
    assert llm.engine.stats.num_accepted_tokens > 0



def test_the_transformers_peer_drafts_across_vocabularies(paths, prompts, tmp_path):
    """bench's transformers peer with a draft of another tokenizer: universal assisted decoding (its tokenizers
    passed), whose greedy output is transformers' plain greedy output; a draft transformers cannot tell apart
    (the same embedding size) is skipped with the reason."""
    from speculant.bench.peers import transformers_peers

    draft = save_tokenizer(save_tiny(tmp_path / "draft", seed=1, num_hidden_layers=1, hidden_size=32,
                                     intermediate_size=64, vocab_size=400), byte_level(CORPUS_B, 400))
    runners, _ = transformers_peers(paths["target"], draft, [3], [2], torch.float32, torch.device("cpu"))
    by_name = {r.name: r for r in runners}
    assistant, plain = by_name["transformers assistant k=3"], by_name["transformers plain"]
    assert assistant.tokenizers is not None
    params = [SamplingParams(temperature=0, max_tokens=8)]
    assert assistant.run(prompts[:1], params).output_ids == plain.run(prompts[:1], params).output_ids
    runners, skipped = transformers_peers(paths["target"], paths["other"], [3], [2], torch.float32,
                                          torch.device("cpu"))
    assert not any(r.method == "assistant" for r in runners) and "vocabulary size is the target's" in skipped[0]


@pytest.mark.parametrize("draft", ["sibling", "other"])
def test_adaptive_k_with_a_draft_of_another_vocabulary_equals_plain(models, paths, prompts, plain, draft):
    """Adaptive k (its cost curve learned on this target, k chosen per step) over both mappings' drafts: the
    tokens are plain greedy's, alone and in a batch of 3."""
    from conftest import greedy_tokens

    spec = {"method": "draft", "model": str(paths[draft]), "num_speculative_tokens": 4, "adaptive": True}
    for batch in (1, 3):
        assert greedy_tokens(models["target"], prompts, spec, max_batch_size=batch, n_tokens=12) == plain, batch
