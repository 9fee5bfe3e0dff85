"""Corpus drafts (proposers/corpus.py): the table keeps what the corpus says, drafts from the longest
context it holds, travels through its file, refuses another vocabulary; prompt lookup goes first."""

from __future__ import annotations

import pytest
import torch

from speculant.config import SamplingParams
from speculant.errors import SpeculantError
from speculant.models.loader import load_model
from speculant.proposers.corpus import CORPUS_BUCKET, CorpusTable, load_corpus
from speculant.proposers.ngram import NgramProposer
from speculant.sampling import SamplingBatch
from speculant.sequence import Sequence


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair[0])


def test_the_table_keeps_frequent_likely_continuations_only(target):
    corpus = [[1, 2, 3, 4]] * 3 + [[1, 2, 3, 5]] + [[7, 2, 3, 6]] * 2 + [[8, 9, 10]] * 2
    table = CorpusTable.build(corpus, target, max_context=3, min_count=3, min_share=0.5)
    assert table.next_token[3] == {(1, 2, 3): 4}  # (7, 2, 3) → 6 seen twice: under min_count
    assert table.next_token[2] == {(1, 2): 3, (2, 3): 4}  # (2, 3) → 4: 3 of 6, min_share 0.5 holds
    strict = CorpusTable.build(corpus, target, max_context=3, min_count=3, min_share=0.6)
    assert (2, 3) not in strict.next_token[2]  # 3 of 6 is not 60%
    assert table.info["tokens"] == sum(map(len, corpus)) and table.info["sequences"] == len(corpus)


def test_drafts_chain_from_the_longest_context_held(target):
    table = CorpusTable({3: {(1, 2, 3): 4}, 2: {(2, 3): 9, (3, 4): 5, (4, 5): 6}}, {})
    assert table.draft([0, 1, 2, 3], 4) == ([4, 5, 6], 3)  # (1, 2, 3) → 4, then (3, 4) → 5, (4, 5) → 6
    assert table.draft([0, 7, 2, 3], 4) == ([9], 2)  # (7, 2, 3) unknown: (2, 3) → 9, then nothing
    assert table.draft([0, 1, 2, 3], 2) == ([4, 5], 3)
    assert table.draft([5, 5], 3) == ([], 0)
    assert table.draft([3], 3) == ([], 0)


def test_the_file_round_trips_and_other_vocabularies_are_refused(target, tmp_path, small_vocab_pair):
    corpus = [[int(t) for t in torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(s))]
              for s in range(3)] * 4
    table = CorpusTable.build(corpus, target)
    assert table.entries > 100
    table.save(tmp_path / "c" / "corpus.safetensors")
    back = load_corpus(tmp_path / "c", target)  # the folder or the file
    assert back.next_token == table.next_token and back.info == table.info
    with pytest.raises(SpeculantError, match="built for another vocabulary \\(size 96\\) than the target's \\(8\\)"):
        load_corpus(tmp_path / "c", load_model(small_vocab_pair[0]))
    with pytest.raises(SpeculantError, match="no corpus table"):
        load_corpus(tmp_path / "missing", target)
    (tmp_path / "bad.safetensors").write_bytes(b"not a table")
    with pytest.raises(SpeculantError, match="not a corpus table"):
        load_corpus(tmp_path / "bad.safetensors", target)


def test_a_long_prompt_match_goes_first_then_the_corpus(target):
    table = CorpusTable({2: {(5, 6): 40, (6, 40): 41}}, {})
    proposer = NgramProposer(1, 6, table)
    assert proposer.name == "ngram+corpus"

    def propose(tokens: list[int]) -> tuple[list[int], int]:
        seq = Sequence("r", tokens, SamplingParams(), 64, None, None)
        p = proposer.propose([seq], [3], SamplingBatch.build([seq.params], [None], torch.device("cpu")))
        return p.tokens[0, :int(p.n_draft[0])].tolist(), p.bucket_list()[0]

    assert propose([3, 5, 6, 7, 3, 5, 6]) == ([7, 3, 5], 3)  # "3 5 6" repeats: prompt lookup
    assert propose([9, 6, 8, 5, 6]) == ([40, 41], CORPUS_BUCKET + 2)  # only "6" repeats: the corpus
    assert propose([9, 6, 8, 1, 6]) == ([8, 1, 6], 1)  # the corpus knows nothing: the 1-token match
