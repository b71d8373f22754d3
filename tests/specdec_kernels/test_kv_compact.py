"""specdec_kernels/kv_compact.py: the reference compaction moves the accepted path's entries into place in every
layer and KV head of one slot (overlapping ranges included), leaves everything else alone, and refuses bad
shapes, dtypes, devices and bounds naming the value."""

import pytest
import torch

from specdec_kernels.kv_compact import kv_compact_ref

T = torch.tensor


def cache(shape=(2, 3, 2, 12, 4)):
    """[L, S, H, M, D]; entry (l, s, h, m, :) holds the number 10000 l + 1000 s + 100 h + m."""
    L, S, H, M, D = shape
    x = (torch.arange(L)[:, None, None, None] * 10000 + torch.arange(S)[None, :, None, None] * 1000
         + torch.arange(H)[None, None, :, None] * 100 + torch.arange(M)[None, None, None, :]).float()
    return x[..., None].expand(*shape).clone()


@pytest.mark.parametrize("src, dst", [
    ([4, 6, 7, 11], 4),  # a path moved down to the tree's base
    ([3, 4, 5], 1),  # overlapping source and destination: every source is read before any write
    ([2, 3, 4], 2),  # already in place
    ([], 5),  # nothing accepted: nothing moves
])
def test_the_path_moves_into_place_in_every_layer_and_head_of_its_slot(src, dst):
    k, v = cache(), -cache()
    k0, v0 = k.clone(), v.clone()
    kv_compact_ref(k, v, 1, T(src, dtype=torch.int64), dst)
    want_k, want_v = k0.clone(), v0.clone()
    for j, s in enumerate(src):
        want_k[:, 1, :, dst + j] = k0[:, 1, :, s]
        want_v[:, 1, :, dst + j] = v0[:, 1, :, s]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # other slots and positions untouched


def test_int32_indices_are_taken_too():
    k, v = cache(), cache()
    kv_compact_ref(k, v, 0, T([5, 7], dtype=torch.int32), 2)
    assert k[0, 0, 0, 2:4, 0].tolist() == [5.0, 7.0]


def test_bad_inputs_are_refused_naming_the_value():
    k = torch.zeros(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="exceed max_model_len=8"):
        kv_compact_ref(k, k.clone(), 0, T([1, 2, 3]), 6)
    with pytest.raises(ValueError, match="slot 2 out of range 0..1"):
        kv_compact_ref(k, k.clone(), 2, T([1]), 0)
    with pytest.raises(ValueError, match="one device"):
        kv_compact_ref(k, k.clone(), 0, T([1], device="meta"), 0)
    with pytest.raises(ValueError, match=r"must both be \[num_layers, num_slots"):
        kv_compact_ref(k, k[0], 0, T([1]), 0)
    with pytest.raises(ValueError, match="k_cache is torch.float32 but v_cache is torch.float16"):
        kv_compact_ref(k, k.half(), 0, T([1]), 0)
    with pytest.raises(ValueError, match=r"src_indices must be \[n\] int64"):
        kv_compact_ref(k, k.clone(), 0, T([1.0]), 0)
