"""Triton tree ops and KV compaction (specdec_kernels/triton_ops/{tree,kv_compact}.py) against the references:
masks, paths and emitted tokens exactly, on hand-written and random trees of odd sizes; compaction also
against the engine's SlotKVCache.compact."""

import pytest
import torch

import specdec_kernels
from specdec_kernels.kv_compact import kv_compact_ref
from specdec.engine.kv_cache import SlotKVCache

REF = specdec_kernels.get_ops("torch")
TRI = specdec_kernels.get_ops("triton")
T = torch.tensor
PARENTS = T([-1, 0, 0, 1, 3, 2])  # the tree of tests/specdec_kernels/test_tree.py


def random_parents(B: int, N: int, g: torch.Generator) -> torch.Tensor:
    """[B, N] random topologically ordered parent arrays (parents[i] < i)."""
    i = torch.arange(N).clamp(min=1)
    parents = (torch.rand(B, N, generator=g) * i).long()
    parents[:, 0] = -1
    return parents


def test_hand_written_tree():
    assert torch.equal(TRI.build_tree_mask(PARENTS), REF.build_tree_mask(PARENTS))
    tokens = T([[0, 5, 6, 7, 8, 1]] * 3)
    argmax = T([[5, 7, 0, 8, 3, 0], [6, 7, 1, 8, 3, 4], [9, 7, 1, 8, 3, 4]])
    path, out = TRI.tree_greedy_accept(PARENTS.expand(3, 6), tokens, argmax)
    assert path.tolist() == [[0, 1, 3, 4, -1, -1], [0, 2, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1]]
    assert out.tolist() == [[5, 7, 8, 3, -1, -1], [6, 1, 4, -1, -1, -1], [9, -1, -1, -1, -1, -1]]
    # equal-depth tie -> lowest node index
    path, out = TRI.tree_greedy_accept(T([[-1, 0, 0]]), T([[0, 4, 4]]), T([[4, 9, 8]]))
    assert path.tolist() == [[0, 1, -1]] and out.tolist() == [[4, 9, -1]]


@pytest.mark.parametrize("B,N", [(1, 1), (3, 2), (5, 7), (3, 29)])
def test_random_trees_match_reference(B, N):
    g = torch.Generator().manual_seed(N)
    parents = random_parents(B, N, g)
    assert torch.equal(TRI.build_tree_mask(parents), REF.build_tree_mask(parents))
    # small token alphabet: many matches, deep accepted paths and ties
    tokens = torch.randint(0, 2, (B, N), generator=g)
    argmax = torch.randint(0, 2, (B, N), generator=g)
    path, out = TRI.tree_greedy_accept(parents, tokens, argmax)
    ref_path, ref_out = REF.tree_greedy_accept(parents, tokens, argmax)
    assert torch.equal(path, ref_path) and torch.equal(out, ref_out)


def test_tree_mask_leading_dims_and_chain():
    chain = torch.arange(-1, 8).view(1, 1, 9)  # [-1, 0, 1, ..., 7]: a causal mask
    assert torch.equal(TRI.build_tree_mask(chain)[0, 0], torch.ones(9, 9, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="dtype"):
        TRI.build_tree_mask(torch.zeros(3))


@pytest.mark.parametrize("shape,slot,src,dst", [
    ((2, 3, 2, 17, 5), 1, [4, 6, 7, 11], 4),  # a path moved down to the tree's base
    ((1, 2, 3, 9, 64), 0, [2, 3, 5], 3),
    ((2, 2, 2, 20, 3), 1, [3, 4, 5], 1),  # overlapping source and destination
    ((3, 1, 1, 40, 7), 0, [], 5),  # nothing accepted
])
def test_kv_compact_matches_reference(shape, slot, src, dst):
    g = torch.Generator().manual_seed(len(src))
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k2, v2 = k.clone(), v.clone()
    idx = T(src, dtype=torch.int64)
    kv_compact_ref(k, v, slot, idx, dst)
    TRI.kv_compact(k2, v2, slot, idx, dst)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_kv_compact_equals_engine_cache_compact():
    cache = SlotKVCache(num_layers=2, num_slots=3, num_kv_heads=2, max_model_len=16, head_dim=6)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    k, v = cache.k.clone(), cache.v.clone()
    slot = cache.allocate()
    cache.lens[slot] = 11  # prompt of 5 + a 6-node tree at 5..10
    src = T([5, 6, 8, 10])  # root and accepted nodes
    cache.compact(slot, src, 5)
    TRI.kv_compact(k, v, slot, src, 5)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_kv_compact_checks():
    k = torch.zeros(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="exceed max_model_len=8"):
        TRI.kv_compact(k, k.clone(), 0, T([1, 2, 3]), 6)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        TRI.kv_compact(k, k.clone(), 2, T([1]), 0)
    with pytest.raises(ValueError, match="one device"):
        TRI.kv_compact(k, k.clone(), 0, T([1], device="meta"), 0)
