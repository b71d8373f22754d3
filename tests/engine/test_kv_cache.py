"""SlotKVCache bookkeeping and compaction, without a model."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.kv_cache import SlotKVCache


def _cache(num_slots: int = 3) -> SlotKVCache:
    return SlotKVCache(num_layers=2, num_slots=num_slots, num_kv_heads=2, max_model_len=16, head_dim=4)


def test_allocate_lowest_free_slot_first():
    c = _cache()
    assert [c.allocate() for _ in range(3)] == [0, 1, 2]
    c.free(1)
    c.free(0)
    assert c.allocate() == 0 and c.allocate() == 1 and c.num_free() == 0


def test_no_free_slot_and_double_free_are_errors():
    c = _cache(2)
    c.allocate(), c.allocate()
    with pytest.raises(RuntimeError, match="num_slots=2"):
        c.allocate()
    c.free(1)
    with pytest.raises(ValueError, match="slot 1 is free"):
        c.free(1)
    with pytest.raises(ValueError, match="out of range"):
        c.free(7)


def test_rollback_is_length_only_and_bounded():
    c = _cache()
    s = c.allocate()
    c.k[:, s, :, :5] = 1.0
    c.lens[s] = 5
    c.rollback(s, 2)
    assert c.seq_len(s) == 2 and c.k[:, s, :, 2:5].eq(1.0).all()  # O(1): data untouched
    with pytest.raises(ValueError, match=r"must be in 0\.\.2"):
        c.rollback(s, 3)


def test_compact_moves_entries_in_every_layer():
    c = _cache()
    s = c.allocate()
    c.allocate()  # a neighbour that must stay untouched
    # entry j of layer l holds value 100*l + j, so moves are visible
    vals = torch.arange(16.0)[None, None, :, None] + 100 * torch.arange(2.0)[:, None, None, None]
    c.k[:, s] = vals.expand(2, 2, 16, 4)
    c.v[:, s] = -vals.expand(2, 2, 16, 4)
    c.lens[s] = 10
    c.compact(s, torch.tensor([5, 7, 9]), 4)
    assert c.seq_len(s) == 7
    for layer in range(2):
        assert c.k[layer, s, 0, 4:7, 0].tolist() == [100 * layer + j for j in (5, 7, 9)]
        assert c.v[layer, s, 1, 4:7, 3].tolist() == [-(100 * layer + j) for j in (5, 7, 9)]
        assert c.k[layer, s, 0, :4, 0].tolist() == [100 * layer + j for j in range(4)]  # prefix kept
    assert c.k[:, 1].eq(0).all()


def test_compact_entry_by_entry_equals_the_gather():
    """A tree step's few ascending sources are copied one entry at a time (no source read after its place was
    overwritten); any ascending set, in place or not, above or overlapping its destination, ends as the gather's."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        a, b = _cache(), _cache()
        s = a.allocate()
        b.allocate()
        data = torch.randn(2, 2, 16, 4, generator=g)
        a.k[:, s], a.v[:, s], b.k[:, s], b.v[:, s] = data, -data, data, -data
        a.lens[s] = b.lens[s] = 12
        n = int(torch.randint(1, 9, (1,), generator=g))
        dst = int(torch.randint(0, 12 - n + 1, (1,), generator=g))
        src = torch.randperm(12 - dst, generator=g)[:n].sort().values + dst  # ascending, each >= dst
        a.compact(s, src, dst)  # the entry-by-entry path (n <= 8)
        idx = src.clone()
        b.k[:, s, :, dst : dst + n] = b.k[:, s, :, idx]  # the gather, by hand
        b.v[:, s, :, dst : dst + n] = b.v[:, s, :, idx]
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.seq_len(s) == dst + n, (trial, src, dst)


def test_compact_rejects_out_of_range():
    c = _cache()
    s = c.allocate()
    c.lens[s] = 6
    with pytest.raises(ValueError, match="outside 0..5"):
        c.compact(s, torch.tensor([4, 6]), 3)
    with pytest.raises(ValueError, match="dst_start=7"):
        c.compact(s, torch.tensor([4]), 7)
    c.compact(s, torch.tensor([], dtype=torch.long), 2)  # accept nothing: a plain rollback
    assert c.seq_len(s) == 2
