"""Packed weights on transparent huge pages (specdec/engine/cpu/hugepages.py): the arena's tensors are ordinary,
independent and page-aligned, survive their chunk's replacement, and products read them as they read any tensor."""

import gc

import pytest
import torch

from specdec.engine.cpu import hugepages, ops


@pytest.fixture
def arena_on(monkeypatch):
    if not hugepages.enabled():
        pytest.skip("transparent huge pages are not offered here (not Linux, or THP is 'never')")
    monkeypatch.setattr(hugepages, "_ON", True)
    monkeypatch.setattr(hugepages, "_ARENA", hugepages._Arena())


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_HUGEPAGES", "0")
    assert not hugepages.enabled()


def test_small_requests_take_torch_empty(arena_on):
    t = hugepages.empty(1000, torch.float32)
    assert t.shape == (1000,) and t.dtype == torch.float32
    assert hugepages._ARENA.chunk is None  # under MIN_BYTES: no chunk was made


def test_large_tensors_are_independent_page_aligned_and_outlive_their_chunk(arena_on):
    n = hugepages.MIN_BYTES // 2 + 123  # bf16 elements: just over MIN_BYTES, an odd size
    ts = [hugepages.empty(n, torch.bfloat16) for _ in range(3 * hugepages.CHUNK // (2 * n) + 2)]  # > 3 chunks
    for i, t in enumerate(ts):
        assert t.shape == (n,) and t.dtype == torch.bfloat16 and t.data_ptr() % 4096 == 0
        t.fill_(float(i % 100))
    assert len({t.data_ptr() for t in ts}) == len(ts)
    hugepages._ARENA.chunk = None  # the arena lets go: the tensors alone keep their chunks
    gc.collect()
    assert all(float(t[0]) == float(i % 100) and float(t[-1]) == float(i % 100) for i, t in enumerate(ts))


def test_a_weight_packed_on_huge_pages_gives_the_same_products(arena_on):
    if ops.lib() is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 576, generator=g).bfloat16()  # 1.2 MB packed: the arena's
    x = torch.randn(5, 576, generator=g)
    on = ops.NativeWeight(w)
    hugepages._ON = False
    off = ops.NativeWeight(w)
    assert on.packed.data_ptr() % 4096 == 0
    assert torch.equal(on.packed, off.packed)
    assert torch.equal(ops.linear(x, on), ops.linear(x, off))
    assert torch.equal(on.w, w) and torch.equal(off.w, w)
