"""NGramProposer on hand-written token arrays; each case says why the answer is what it is."""

import time

import numpy as np
import pytest
import torch

from proposers.ngram import NGramProposer, ngram_lookup
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch


def lookup(tokens, k=3, min_n=1, max_n=3):
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), k, min_n, max_n).tolist()


def test_longest_match_wins():
    # suffix [1, 2, 3]: the 3-gram occurs at 0 (followed by 9, 9); the 1-gram [3] also occurs later at 7
    # (followed by 7): the longer match wins even though the shorter one is more recent.
    assert lookup([1, 2, 3, 9, 9, 5, 5, 3, 7, 1, 2, 3]) == [9, 9, 5]


def test_most_recent_occurrence_of_the_longest_match():
    # [4, 5] occurs at 0 (followed by 1) and at 3 (followed by 2): the most recent one is taken.
    assert lookup([4, 5, 1, 4, 5, 2, 8, 4, 5], k=2, max_n=2) == [2, 8]


def test_no_match_gives_length_zero():
    # the last token 6 never occurs earlier: nothing to copy
    assert lookup([1, 2, 3, 4, 5, 6]) == []
    assert lookup([7]) == []  # a single token has no earlier context at all


def test_match_near_the_end_gives_a_shorter_proposal():
    # the suffix [1, 2] (at 5..6) last occurred at 3..4; only 2 tokens (5..6) follow that occurrence,
    # so k=4 gets a proposal of 2
    assert lookup([9, 9, 9, 1, 2, 1, 2], k=4, max_n=2) == [1, 2]


def test_min_and_max_are_respected():
    # only a 1-gram ([5]) matches: min_n=2 refuses it
    toks = [5, 7, 1, 5]
    assert lookup(toks, min_n=1, max_n=3) == [7, 1, 5]
    assert lookup(toks, min_n=2, max_n=3) == []
    # a 3-gram [1, 2, 3] matches at 0 (-> 4) and the 1-gram [3] at 5 (-> 6); with max_n=1 the lookup
    # never considers n = 3 and takes the most recent 1-gram
    toks = [1, 2, 3, 4, 0, 3, 6, 1, 2, 3]
    assert lookup(toks, k=1, min_n=1, max_n=3) == [4]
    assert lookup(toks, k=1, min_n=1, max_n=1) == [6]


def _batch(token_ids, k):
    n = len(token_ids)
    return ProposeBatch(seq_ids=list(range(n)), token_ids=token_ids, k=k,
                        sampling_params=[SamplingParams(temperature=0.0)] * n, generators=[None] * n)


def test_batch_pads_with_minus_one_and_reports_lens():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    prop = NGramProposer(target=None, config=cfg)
    out = prop.propose(_batch([[1, 2, 3, 1, 2], [1, 2, 3], [4, 4]], k=3))
    assert out.probs is None  # deterministic drafts: the wrapper makes q one-hot
    assert out.lens.tolist() == [3, 0, 1]
    assert out.token_ids.tolist() == [[3, 1, 2], [-1, -1, -1], [4, -1, -1]]
    assert out.token_ids.dtype == torch.long


def test_fast_at_2k_tokens():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 49152, 2000)
    toks[-4:] = toks[100:104]  # a 4-gram match far back
    seq = toks.tolist()
    assert lookup(seq, k=5, max_n=4) == toks[104:109].tolist()
    t0 = time.perf_counter()
    for _ in range(100):
        lookup(seq, k=5, max_n=4)
    per_seq = (time.perf_counter() - t0) / 100
    assert per_seq < 1e-3, f"ngram lookup took {per_seq * 1e3:.2f} ms per 2k-token sequence"


def test_periodic_text_prefers_the_latest_match_with_k_tokens_after_it():
    from proposers.ngram import ngram_lookup

    # a greedy loop "5 5 5 5 5 5": the most recent match of [5] ends at index 4 and has one token after
    # it; the latest match with k=3 tokens after it ends at index 2 -> a full proposal of three 5s.
    toks = np.array([5, 5, 5, 5, 5, 5])
    assert ngram_lookup(toks, 3, 1, 1).tolist() == [5, 5, 5]
    # period 2 with k=4: suffix [7, 8]; the latest occurrence with 4 tokens after it starts at index 0
    toks = np.array([7, 8, 7, 8, 7, 8])
    assert ngram_lookup(toks, 4, 2, 2).tolist() == [7, 8, 7, 8]


def reference_lookup(toks: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The module docstring's rule, in plain Python: the longest n in [min_n, max_n] whose last-n-token suffix
    occurs earlier (ending before the last token); of its occurrences the most recent with k tokens after it,
    else the earliest."""
    L = len(toks)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        ends = [e for e in range(n - 1, L - 1) if toks[e - n + 1:e + 1] == toks[L - n:]]
        if ends:
            full = [e for e in ends if e + k < L]
            e = full[-1] if full else ends[0]
            return toks[e + 1:e + 1 + k]
    return []


def reference_match_length(toks: list[int], min_n: int, max_n: int) -> int:
    """The n reference_lookup drafts from (0: none)."""
    L = len(toks)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        if any(toks[e - n + 1:e + 1] == toks[L - n:] for e in range(n - 1, L - 1)):
            return n
    return 0


def test_lookup_equals_the_plain_python_rule():
    rng = np.random.default_rng(0)
    nonempty = 0
    for _ in range(3000):
        L, V = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        toks = rng.integers(0, V, L).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        want = reference_lookup(toks, k, lo, hi)
        assert lookup(toks, k, lo, hi) == want, (toks, k, lo, hi)
        nonempty += bool(want)
    assert nonempty > 1000  # most cases propose something: the comparison is not vacuous


def test_drafts_from_the_sequences_equal_drafts_from_lists():
    """Top1Proposer's batches carry the SequenceData (token_arrays reads them without lists, token_ids makes lists
    only when read): the same drafts as a batch of plain lists, from propose and from draft_lists (shadow drafts)."""
    from specdec.datamodel.sequence import SequenceData
    from specdec.spec_decode.proposer import TokenLists

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    prop = NGramProposer(target=None, config=cfg)
    rows = [[1, 2, 3, 1, 2], [1, 2, 3], [4, 4]]
    seqs = [SequenceData.from_seqs(r[:2], r[2:]) for r in rows]
    lazy = TokenLists(seqs)
    assert not lazy._lists and lazy == rows and lazy[-1] == [4, 4] and lazy[1:] == rows[1:]
    plain = prop.propose(_batch(rows, k=3))
    batch = _batch(rows, k=3)
    batch.token_ids, batch.sequences = TokenLists(seqs), seqs
    got = prop.propose(batch)
    assert got.token_ids.tolist() == plain.token_ids.tolist() and got.lens.tolist() == plain.lens.tolist()
    assert not batch.token_ids._lists  # the lookups never built the lists
    batch.row_k = [2, 3, 3]
    assert prop.draft_lists(batch) == [[3, 1], [], [4]]
    for d in seqs:  # the arrays were read through numpy views: they can still grow
        d.append_token_id(7, 0.0)
    assert [a.tolist() for a in batch.token_arrays()] == [r + [7] for r in rows]


def test_the_index_equals_the_lookup_as_sequences_grow():
    """NGramIndex (what the proposer and the branch use) against ngram_lookup after every append, for sequences that
    grow by 1-4 tokens a step, read from lists and from SequenceData, with k, min_n and max_n varying."""
    from proposers.ngram import NGramIndex
    from specdec.datamodel.sequence import SequenceData

    rng = np.random.default_rng(1)
    checked = nonempty = 0
    for case in range(300):
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        V = int(rng.integers(1, 8))
        idx_list, idx_data = NGramIndex(lo, hi), NGramIndex(lo, hi)
        prompt = rng.integers(0, V, int(rng.integers(1, 12))).tolist()
        data = SequenceData.from_seqs(prompt, [])
        toks = list(prompt)
        for _ in range(int(rng.integers(1, 12))):
            k = int(rng.integers(1, 6))
            want = lookup(toks, k, lo, hi)
            assert idx_list.lookup(case, list(toks), k) == want, (toks, k, lo, hi)
            assert idx_data.lookup(case, data, k) == want, (toks, k, lo, hi)
            assert idx_data.match_length(case, data) == reference_match_length(toks, lo, hi), (toks, lo, hi)
            checked += 1
            nonempty += bool(want)
            for t in rng.integers(0, V, int(rng.integers(1, 5))).tolist():
                toks.append(t)
                data.append_token_id(t, 0.0)
    assert checked > 1500 and nonempty > checked // 2  # not vacuous


def test_the_index_re_indexes_a_cut_back_or_reused_sequence_and_frees():
    from proposers.ngram import NGramIndex

    idx = NGramIndex(1, 3)
    assert idx.lookup(7, [1, 2, 3, 1, 2], 3) == [3, 1, 2]
    # the same id, shorter: re-indexed, not read from the stale entry
    assert idx.lookup(7, [1, 2, 1], 2) == [2, 1]
    # the same id and length-or-more but another last token at the indexed end: re-indexed
    assert idx.lookup(7, [5, 6, 5, 9], 2) == []
    assert idx.lookup(7, [5, 6, 5, 9, 5], 2) == [9, 5]  # the latest 5 with 2 tokens after it
    assert len(idx) == 1
    idx.free(7)
    idx.free(7)  # twice: harmless
    assert len(idx) == 0
    with pytest.raises(ValueError, match="min_n=3 / max_n=2"):
        NGramIndex(3, 2)


def test_the_proposer_frees_its_index_with_the_sequence():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    prop = NGramProposer(target=None, config=cfg)
    prop.propose(_batch([[1, 2, 3, 1, 2], [1, 2, 3]], k=3))
    assert len(prop.index) == 2
    prop.free(0)
    prop.free(1)
    assert len(prop.index) == 0


def test_the_draft_classes_are_the_match_lengths():
    """NGramProposer.draft_classes: each row's match length, 0 where it drafts nothing (the goodput policy's classes)."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    prop = NGramProposer(target=None, config=cfg)
    rows = [[1, 2, 3, 9, 1, 2, 3], [4, 5, 6, 5], [7, 8, 9]]
    assert prop.draft_classes(_batch(rows, k=3)) == [3, 1, 0]
    assert prop.propose(_batch(rows, k=3)).lens.tolist() == [3, 2, 0]
