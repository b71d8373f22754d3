"""The batched slot-range attention equals the per-sequence one (the readable reference)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.attention import PerSequenceAttention, SlotRangeAttention, plan_attention
from specdec.engine.kv_cache import SlotKVCache

NH, NKV, HD = 4, 2, 8


def _cache_with_prefixes(starts: dict[int, int]) -> SlotKVCache:
    c = SlotKVCache(1, 6, NKV, 32, HD)
    g = torch.Generator().manual_seed(0)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    for _ in range(6):
        c.allocate()
    for s, n in starts.items():
        c.lens[s] = n  # as if prefilled with n tokens
    return c


def _tree(n: int, B: int) -> torch.Tensor:
    # per sequence: node i's parent is (i - 1) // 2 (a binary tree), ancestors incl. itself visible
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = (j - 1) // 2 if j else -1
    return m.repeat(B, 1)


@pytest.mark.parametrize("slots", [[0, 1, 2], [4, 0, 2], [3, 5]])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("tree", [False, True])
def test_slot_range_equals_per_sequence(slots, n, tree):
    starts = {s: 5 + 3 * i for i, s in enumerate(slots)}
    g = torch.Generator().manual_seed(1)
    T = n * len(slots)
    q, k, v = (torch.randn(T, h, HD, generator=g) for h in (NH, NKV, NKV))
    tm = _tree(n, len(slots)) if tree else None
    ref_cache, fast_cache = _cache_with_prefixes(starts), _cache_with_prefixes(starts)
    st = [starts[s] for s in slots]
    ref = PerSequenceAttention(ref_cache, slots, st, [n] * len(slots), tm, NH, True)(0, q, k, v)
    fast = SlotRangeAttention(fast_cache, slots, st, n, tm, NH, True)(0, q, k, v)
    torch.testing.assert_close(fast, ref)
    torch.testing.assert_close(fast_cache.k, ref_cache.k)
    torch.testing.assert_close(fast_cache.v, ref_cache.v)


def test_plan_picks_range_only_for_uniform_narrow_batches():
    c = _cache_with_prefixes({0: 1, 1: 1, 2: 1, 5: 1})
    assert isinstance(plan_attention(c, [0, 1, 2], [1, 1, 1], [1, 1, 1], None, NH, NKV), SlotRangeAttention)
    assert isinstance(plan_attention(c, [0, 1, 2], [1, 1, 1], [1, 2, 1], None, NH, NKV), PerSequenceAttention)
    assert isinstance(plan_attention(c, [0, 5], [1, 1], [1, 1], None, NH, NKV), PerSequenceAttention)  # span 6 > 2*2
    assert isinstance(plan_attention(c, [0], [1], [1], None, NH, NKV), PerSequenceAttention)
