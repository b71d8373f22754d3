"""Triton KV compaction of an accepted tree path; reference and conventions in ``specdec_kernels/kv_compact.py``.

Program (layer x head, d-block) loads all n source rows of its [n, BLOCK_D] column block, waits at a
barrier, then stores them at ``dst_start ..``: programs touch disjoint columns, and within one program
every read precedes every write, so overlapping source/destination ranges are safe without a copy.
Source indices outside [0, max_model_len) are skipped (never read out of bounds); the engine's
``SlotKVCache.compact`` checks them against the slot length before calling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.kv_compact import check_kv_compact
from specdec_kernels.triton_ops._common import MAX_TILE, pow2


@triton.jit(do_not_specialize=["n", "dst_start", "slot"])
def _kv_compact_kernel(k_ptr, v_ptr, s_l, s_s, s_h, s_m, s_d,  # [L, S, H, M, D], same strides for k and v
                       src_ptr,  # [n]
                       slot, n, dst_start, H, M, D,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    lh = tl.program_id(0)
    layer = (lh // H).to(tl.int64)
    head = (lh % H).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_N)
    src = tl.load(src_ptr + r, mask=r < n, other=-1).to(tl.int64)
    ok = ((src >= 0) & (src < M))[:, None] & (cols[None, :] < D)
    base = layer * s_l + slot.to(tl.int64) * s_s + head * s_h
    src_off = base + src[:, None] * s_m + cols[None, :] * s_d
    dst_off = base + (dst_start + r.to(tl.int64))[:, None] * s_m + cols[None, :] * s_d
    k = tl.load(k_ptr + src_off, mask=ok)
    v = tl.load(v_ptr + src_off, mask=ok)
    tl.debug_barrier()  # all reads of this block before any write
    tl.store(k_ptr + dst_off, k, mask=ok)
    tl.store(v_ptr + dst_off, v, mask=ok)


def kv_compact(k_cache: torch.Tensor,  # [L, S, H, M, D] KV cache, modified in place
               v_cache: torch.Tensor,  # [L, S, H, M, D]
               slot: int,  # the sequence's slot
               src_indices: torch.Tensor,  # [n] int64 cache positions of the accepted path, in [0, M)
               dst_start: int,  # first destination position; dst_start + n <= M
               ) -> None:
    n = check_kv_compact("kv_compact[triton]", k_cache, v_cache, slot, src_indices, dst_start)
    if n == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"kv_compact[triton]: k_cache strides {k_cache.stride()} differ from v_cache's "
                         f"{v_cache.stride()}; allocate both caches alike.")
    L, _, H, M, D = k_cache.shape
    BLOCK_N = pow2(n)
    BLOCK_D = max(1, min(pow2(D), MAX_TILE // BLOCK_N))
    _kv_compact_kernel[(L * H, triton.cdiv(D, BLOCK_D))](
        k_cache, v_cache, *k_cache.stride(), src_indices.contiguous(), slot, n, dst_start, H, M, D,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
