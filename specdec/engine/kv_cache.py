"""A KV cache held per slot: one contiguous region of ``max_model_len`` positions per live sequence.

Layout ``k, v: [num_layers, num_slots, num_kv_heads, max_model_len, head_dim]``, so one slot's keys of
one layer, ``k[layer, slot, :, :n]``, are a strided view that attention reads without a copy. A slot's
length is a Python int: rollback is setting it (O(1)); entries past it are stale and overwritten by
the next append. This module knows nothing about the model or attention masks.
"""

from __future__ import annotations

import heapq

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1 or max_model_len < 1:
            raise ValueError(f"SlotKVCache: num_slots={num_slots} and max_model_len={max_model_len} must be >= 1")
        shape = (num_layers, num_slots, num_kv_heads, max_model_len, head_dim)
        # zeros, not empty: stale-but-finite entries are harmless, NaN garbage behind a mask is not
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except RuntimeError as e:  # out of memory: name what asked for it
            need = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raise ValueError(f"SlotKVCache: {num_slots} slots (max_num_seqs) x {max_model_len} tokens (max_model_len) "
                             f"need {need / 2**30:.1f} GiB of KV cache, which could not be allocated ({str(e)[:80]}); "
                             "lower max_num_seqs or max_model_len") from None
        # per-layer views, so the hot path indexes one dimension less
        self.k_layers = list(self.k.unbind(0))  # [num_slots, nkv, M, hd] each
        self.v_layers = list(self.v.unbind(0))
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.lens = [0] * num_slots  # tokens held per slot
        # kv_compact(k, v, slot, src_indices, dst_start) of a kernels backend; None = the torch copy below
        self.compact_op = None
        self._allocated = [False] * num_slots
        self._free = list(range(num_slots))  # min-heap: the lowest free slot is handed out first

    # ---- slot bookkeeping ----------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                f"SlotKVCache: no free slot (num_slots={self.num_slots} all in use); free a finished "
                f"sequence's slot or raise num_slots"
            )
        slot = heapq.heappop(self._free)
        self._allocated[slot] = True
        self.lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.check_allocated(slot)
        self._allocated[slot] = False
        self.lens[slot] = 0
        heapq.heappush(self._free, slot)

    def num_free(self) -> int:
        return len(self._free)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and self._allocated[slot]

    def check_allocated(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"SlotKVCache: slot {slot} out of range 0..{self.num_slots - 1}")
        if not self._allocated[slot]:
            raise ValueError(f"SlotKVCache: slot {slot} is free; allocate_slot() it first (or free it only once)")

    def seq_len(self, slot: int) -> int:
        self.check_allocated(slot)
        return self.lens[slot]

    def rollback(self, slot: int, length: int) -> None:
        self.check_allocated(slot)
        if not 0 <= length <= self.lens[slot]:
            raise ValueError(f"SlotKVCache: rollback of slot {slot} to {length}; must be in 0..{self.lens[slot]}")
        self.lens[slot] = length

    # ---- data movement -------------------------------------------------------------------------
    def compact(self, slot: int, src_indices: torch.Tensor, dst_start: int) -> None:
        """Copy entries ``src_indices`` ([n] int64, ascending, < seq_len) to ``dst_start..dst_start+n-1``
        in every layer, then set the length to ``dst_start + n``."""
        self.check_allocated(slot)
        n = int(src_indices.numel())
        cur = self.lens[slot]
        if not 0 <= dst_start <= cur:
            raise ValueError(f"SlotKVCache.compact: dst_start={dst_start} must be in 0..seq_len={cur} (slot {slot})")
        if dst_start + n > self.max_model_len:
            raise ValueError(
                f"SlotKVCache.compact: dst_start={dst_start} + {n} entries exceed max_model_len={self.max_model_len}"
            )
        if n:
            few = src_indices.tolist() if n <= 8 else None  # a tree step's path: a list, fewer tensor ops
            lo, hi = (min(few), max(few)) if few else (int(src_indices.min()), int(src_indices.max()))
            if lo < 0 or hi >= cur:
                raise ValueError(
                    f"SlotKVCache.compact: src_indices span {lo}..{hi}, outside 0..{cur - 1} (slot {slot})"
                )
            if self.compact_op is not None:  # a kernels backend's kv_compact (e.g. Triton), same semantics
                self.compact_op(self.k, self.v, slot, src_indices.to(device=self.k.device, dtype=torch.long), dst_start)
            elif few and all(b > a for a, b in zip(few, few[1:])) and few[0] >= dst_start:
                # ascending and never below its destination: every later source lies past entry j's destination, so
                # copying one entry at a time in order reads no entry already overwritten (2 strided copies each,
                # against 4 advanced-index gathers and writes)
                for j, src in enumerate(few):
                    if src != dst_start + j:
                        self.k[:, slot, :, dst_start + j] = self.k[:, slot, :, src]
                        self.v[:, slot, :, dst_start + j] = self.v[:, slot, :, src]
            else:
                # gather first (advanced indexing copies), then write: overlapping ranges are safe
                idx = src_indices.to(device=self.k.device, dtype=torch.long)
                self.k[:, slot, :, dst_start : dst_start + n] = self.k[:, slot, :, idx]
                self.v[:, slot, :, dst_start : dst_start + n] = self.v[:, slot, :, idx]
        self.lens[slot] = dst_start + n

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy entries ``0..length-1`` of slot ``src`` to slot ``dst`` in every layer; dst's length
        becomes ``length`` (whatever it held before is dropped)."""
        self.check_allocated(src)
        self.check_allocated(dst)
        if src == dst:
            raise ValueError(f"SlotKVCache.copy_prefix: src and dst are both slot {src}; pass two slots")
        if not 0 <= length <= self.lens[src]:
            raise ValueError(f"SlotKVCache.copy_prefix: length={length} must be in 0..seq_len={self.lens[src]} "
                             f"of the source slot {src}; prefill it first")
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]  # [layers, nkv, length, hd]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.lens[dst] = length
