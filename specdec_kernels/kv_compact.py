"""KV compaction after tree verification: move the accepted path's cache entries into place.

A tree step appends all N tree nodes to a sequence's KV slot at positions ``base .. base+N-1``; only the
accepted root-to-node path survives. Its entries (cache positions ``src_indices``, ascending) are copied
to ``dst_start ..`` (usually ``base``) in every layer and KV head, so the slot again holds one contiguous
sequence; the caller then sets the slot's length to ``dst_start + n``. Overlapping source and destination
ranges are safe (every source is read before any destination is written).

Layout of the slot KV cache (``specdec/engine/kv_cache.py``):
``[num_layers, num_slots, num_kv_heads, max_model_len, head_dim]``. Knows nothing about slot lengths.
"""

from __future__ import annotations

import torch


def check_kv_compact(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int,
                     src_indices: torch.Tensor, dst_start: int) -> int:
    """The number of entries to move, after checking shapes, dtypes, devices and bounds (no host sync)."""
    if k_cache.dim() != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[num_layers, num_slots, num_kv_heads, max_model_len, head_dim].")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}.")
    if src_indices.dim() != 1 or src_indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: src_indices must be [n] int64 (got {tuple(src_indices.shape)} {src_indices.dtype}).")
    if len({k_cache.device, v_cache.device, src_indices.device}) != 1:
        raise ValueError(f"{op}: k_cache ({k_cache.device}), v_cache ({v_cache.device}) and src_indices "
                         f"({src_indices.device}) must be on one device.")
    _, S, _, M, _ = k_cache.shape
    n = src_indices.numel()
    if not 0 <= slot < S:
        raise ValueError(f"{op}: slot {slot} out of range 0..{S - 1}.")
    if dst_start < 0 or dst_start + n > M:
        raise ValueError(f"{op}: dst_start={dst_start} + {n} entries exceed max_model_len={M}.")
    return n


def kv_compact_ref(k_cache: torch.Tensor,  # [L, S, H, M, D] KV cache, modified in place
                   v_cache: torch.Tensor,  # [L, S, H, M, D]
                   slot: int,  # the sequence's slot
                   src_indices: torch.Tensor,  # [n] int64 cache positions of the accepted path, in [0, M)
                   dst_start: int,  # first destination position; dst_start + n <= M
                   ) -> None:
    n = check_kv_compact("kv_compact", k_cache, v_cache, slot, src_indices, dst_start)
    if n == 0:
        return
    idx = src_indices.to(torch.int64)
    # gather first (advanced indexing copies), then write: overlapping ranges are safe
    k_cache[:, slot, :, dst_start:dst_start + n] = k_cache[:, slot, :, idx]
    v_cache[:, slot, :, dst_start:dst_start + n] = v_cache[:, slot, :, idx]
