"""FeatureStore holds the same rows as one HiddenStates threaded the old way (extend / select / discard)."""

import random

import pytest
import torch

from specdec.datamodel.hidden_states import HiddenStates
from specdec.spec_decode.feature_store import FeatureStore


def rows_of(hs: HiddenStates, s: int) -> torch.Tensor:
    idx = [i for i, o in enumerate(hs.seq_ids) if o == s]
    return hs.hidden_states[idx]


@pytest.mark.parametrize("history", [None, 1, 3])
def test_same_rows_as_hidden_states(history):
    rng = random.Random(history or 0)
    g = torch.Generator().manual_seed(0)
    ref = HiddenStates(torch.zeros(0, 4), None, None, [])
    store = FeatureStore()
    live = set()
    for step in range(60):
        seqs = rng.sample(range(6), rng.randint(1, 4))
        owners = [s for s in seqs for _ in range(rng.randint(1, 5))]  # each sequence's rows contiguous
        feats = torch.randn(len(owners), 4, generator=g)
        ref.extend(feats, owners, history)
        store.extend(feats, owners, history)
        live |= set(seqs)
        if step % 7 == 3:  # a step's proposer read some sequences: their rows are spent
            gone = set(rng.sample(sorted(live), min(2, len(live))))
            ref.discard(gone)
            store.discard(gone)
            live -= gone
        want = rng.sample(range(6), 3)
        got, exp = store.select(want), ref.select(want)
        assert sorted(got.seq_ids) == sorted(exp.seq_ids)
        for s in set(exp.seq_ids):
            assert torch.equal(rows_of(got, s), rows_of(exp, s)), (step, s)


def test_copy_is_a_snapshot_and_rows_are_not_pinned_views():
    store = FeatureStore()
    big = torch.arange(12.0).reshape(6, 2)
    store.extend(big, [0, 0, 1, 1, 1, 2])
    snap = store.copy()
    store.extend(torch.ones(1, 2), [0])
    store.discard({1})
    assert snap.seq_ids == [0, 0, 1, 1, 1, 2] and torch.equal(snap.hidden_states, big)
    assert store.seq_ids == [0, 0, 0, 2]
    r = store.rows(0)
    assert r.shape == (3, 2) and r.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert store.select([5]).hidden_states.shape == (0, 2)


def test_rows_are_kept_in_the_first_dtype():
    store = FeatureStore()
    store.extend(torch.ones(2, 3), [4, 4])
    store.extend(torch.ones(1, 3, dtype=torch.bfloat16), [4])
    assert store.rows(4).dtype == torch.float32 and store.rows(4).shape == (3, 3)
    with pytest.raises(ValueError, match="3 rows for 2 owners"):
        store.extend(torch.ones(3, 3), [1, 2])
