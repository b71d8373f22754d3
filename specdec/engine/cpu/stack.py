"""`NativeStack`: a `Llama`'s decoder stack run by the CPU kernels in one call per forward.

Built once per engine: the weights packed (``ops.NativeWeight``), one ``SdLayer`` per layer pointing at
them and at the engine's fp32 KV cache. A forward then describes its T rows (slot, cache start, index among
its sequence's new tokens, mask, RoPE tables) and calls ``sd_forward`` once: every layer, every row, on
torch's OpenMP threads, with a barrier between phases. Python pays one call, not ~20 ops per layer.

Weights may be fp32, bf16 or fp16; activations, the cache and outputs are fp32 (``kernels.cpp``); a bf16 model's
attention reads the kernels' own bf16 copies of K and V where the build dots bf16 (``ops.attention_copies``).
This module knows nothing about requests, sampling or speculation.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from specdec.engine.cpu import ops
from specdec.engine.cpu.ops import NativeWeight, SdLayer, SdModel, SdRows, SdScratch, fptr
from specdec.engine.interface import LogitStats

__all__ = ["NativeStack", "Scratch", "sd_rows", "stack_unsupported"]

_ip = ctypes.POINTER(ctypes.c_int64)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): the plain weight copies just dropped
    were allocated below malloc's mmap threshold and would otherwise stay in the process's RSS."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def stack_unsupported(model) -> str | None:
    """Why the kernels cannot run ``model`` (None when they can; they keep the KV cache in fp32)."""
    if ops.lib() is None:
        from specdec.engine.cpu.build import status

        return status()
    if model.dtype not in ops.WDTYPES:
        return f"weight dtype {model.dtype} (the kernels read {', '.join(map(str, ops.WDTYPES))})"
    if model.device.type != "cpu":
        return f"device {model.device}"
    if model.config.head_dim > 1024:
        return f"head_dim={model.config.head_dim} > 1024"
    return None


def sd_rows(T: int, slots: list[int], starts: list[int], qlens: list[int], cos: torch.Tensor, sin: torch.Tensor,
            tree_mask: torch.Tensor | None, kt_valid: np.ndarray) -> tuple[SdRows, tuple]:
    """The ``SdRows`` of a forward's T new rows, sequence after sequence (``qlens`` each, appended at each
    slot's ``starts``), and the arrays it points into, to keep alive until the call returns."""
    ql = np.asarray(qlens, dtype=np.int64)
    rows = np.empty((4, T), dtype=np.int64)  # slot, start, index, nnew
    if len(qlens) == 1:
        rows[0], rows[1], rows[2], rows[3] = slots[0], starts[0], np.arange(T), T
    else:
        rows[0] = np.repeat(np.asarray(slots, dtype=np.int64), ql)
        rows[1] = np.repeat(np.asarray(starts, dtype=np.int64), ql)
        rows[2] = np.arange(T) - np.repeat(np.cumsum(ql) - ql, ql)
        rows[3] = np.repeat(ql, ql)
    mask = None if tree_mask is None else tree_mask.to(torch.uint8).contiguous()
    p = rows.ctypes.data
    r = SdRows(
        T, ctypes.cast(p, _ip), ctypes.cast(p + 8 * T, _ip), ctypes.cast(p + 16 * T, _ip), ctypes.cast(p + 24 * T, _ip),
        None if mask is None else ctypes.cast(mask.data_ptr(), ctypes.POINTER(ctypes.c_uint8)),
        0 if mask is None else mask.shape[1], fptr(cos), fptr(sin), ctypes.cast(kt_valid.ctypes.data, _ip),
    )  # fmt: skip
    return r, (rows, mask, cos, sin)


class Scratch:
    """The kernels' work buffers (``SdScratch``) for a layer shape, grown (doubling) to the rows a call needs.
    ``attn_in``: the width of a given attention input (``sd_layer_from``), when wider than the others."""

    def __init__(self, cfg, attn_in: int = 0) -> None:
        D, I, A = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
        Q = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        self.widths, self.xb_width = (D, Q, A, 2 * I, I), max(D, A, I, attn_in)
        self.rows = 0
        self.desc: SdScratch | None = None

    def __call__(self, T: int) -> SdScratch:
        if T > self.rows:
            n = max(T, 2 * self.rows)
            self._bufs = [torch.empty(n, d) for d in self.widths]  # h, qkv, att, gu, act
            self._xb = torch.empty(n * self.xb_width, dtype=torch.int16)
            self.desc = SdScratch(*[fptr(b) for b in self._bufs], ctypes.cast(self._xb.data_ptr(), ctypes.POINTER(ctypes.c_uint16)))
            self.rows = n
        return self.desc


class NativeStack:
    def __init__(self, model, cache, share: NativeStack | None = None,
                 attention_dtype: torch.dtype | None = None) -> None:
        """model: llama.Llama; cache: its engine's kv_cache.SlotKVCache (fp32); share: a stack over the same
        weights (a layer-skip draft's parent) whose packed copies to reuse; attention_dtype: the dtype whose rule
        decides the attention's copies of K and V (ops.attention_copies; None: the weights'; torch.float32 keeps a
        bf16 model's attention in fp32, as experiments/bench/attention_copies.py compares)."""
        c = model.config
        self.cfg = c
        self.model = SdModel(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, c.rms_norm_eps)  # fmt: skip
        self._keep: list = []  # tensors the structs point into
        n = len(model.layers)
        self.layers = (SdLayer * n)()
        # K in blocks of VL keys for the attention's scores (kernels.cpp, SdCache.kt) and, for a bf16 model where the
        # build dots bf16, V in bf16 (vh): filled lazily from the cache, valid up to kt_valid (ops.attention_copies)
        self.vl = ops.lib().sd_vl()
        S = cache.k_layers[0].shape[0]
        shape = tuple(cache.k_layers[0].shape)
        self.kt, self.vh = ops.attention_copies(shape, attention_dtype or model.dtype, (n,))  # [n, S, nkv, Lt | L, hd]
        self.kt_valid = np.zeros(S, dtype=np.int64)  # per slot: keys [0, kt_valid) are in self.kt
        self.weights: list[list[NativeWeight]] = []
        for i, L in enumerate(model.layers):
            if share is not None and i < len(share.weights):
                w = share.weights[i]
            else:
                w = [NativeWeight(L.wqkv.w_t, L.wqkv.bias), NativeWeight(L.wo.w_t, L.wo.bias),
                     NativeWeight(L.w13.w_t), NativeWeight(L.w2.w_t)]  # fmt: skip
            self.weights.append(w)
            norms = [L.attn_norm.float().contiguous(), L.ffn_norm.float().contiguous()]
            self._keep += norms
            k, v = cache.k_layers[i], cache.v_layers[i]  # [S, nkv, L, hd] fp32 views
            sc = ops.sd_cache(k, v, self.kt[i], None if self.vh is None else self.vh[i])
            self.layers[i] = SdLayer(fptr(norms[0]), w[0].desc, w[1].desc, fptr(norms[1]), w[2].desc, w[3].desc, sc)
        self.norm = model.norm.float().contiguous()
        self.lm_head = share.lm_head if share is not None else NativeWeight(model.lm_head.w_t)
        self.num_layers = n
        self.scratch = Scratch(c)
        model.keep_packed(self.weights, self.lm_head)  # the packed copies become the only ones
        release_freed_memory()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed weights this stack reads (every projection and the LM head)."""
        return sum(w.nbytes for ws in self.weights for w in ws) + self.lm_head.nbytes

    def forward(
        self,
        x: torch.Tensor,  # [T, D] fp32 input embeddings; becomes the last layer's output (pre final norm)
        slots: list[int],  # [B]
        starts: list[int],  # [B] each slot's length before this forward
        qlens: list[int],  # [B] new tokens per sequence
        cos: torch.Tensor,  # [T, hd] fp32 at each row's position
        sin: torch.Tensor,  # [T, hd] fp32 (signed)
        tree_mask: torch.Tensor | None,  # [T, >= max(qlens)] bool, or None = causal
        hidden_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (final-normed hidden states [T, D] fp32, outputs of ``hidden_layers`` [T, D] each)."""
        T = x.shape[0]
        r, _hold = sd_rows(T, slots, starts, qlens, cos, sin, tree_mask, self.kt_valid)
        outs = {i: torch.empty_like(x) for i in hidden_layers}
        aux_ptrs = None
        if outs:
            aux_ptrs = (ctypes.c_void_p * self.num_layers)()
            for i, a in outs.items():
                aux_ptrs[i] = a.data_ptr()
        s = self.scratch(T)
        ops.lib().sd_forward(ctypes.byref(self.model), self.layers, self.num_layers, ctypes.byref(r), fptr(x), ctypes.byref(s), aux_ptrs)
        for slot, start, n in zip(slots, starts, qlens):
            self.kt_valid[slot] = start + n  # the forward transposed every key it read
        return ops.rmsnorm(x, self.norm, self.cfg.rms_norm_eps), [outs[i] for i in hidden_layers]

    def truncate(self, slot: int, length: int) -> None:
        """The slot's keys past ``length`` changed or went (rollback, compaction, a new sequence): their
        blocked copies will be made again from the cache when next read."""
        self.kt_valid[slot] = min(int(self.kt_valid[slot]), length)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """After the cache copied src's keys [0, length) to dst: dst's blocked copies are src's valid ones
        up to ``length``. Key j sits in block j // VL of a slot's [Lt / VL, hd, VL] layout, so the first
        ceil(n / VL) blocks hold keys [0, n) (and stale keys past n in the last block, as after a rollback:
        kt_valid says they are not there)."""
        n = min(int(self.kt_valid[src]), length)
        m = (n + self.vl - 1) // self.vl * self.vl  # whole blocks: rows [0, m) of the [Lt, hd] view
        self.kt[:, dst, :, :m] = self.kt[:, src, :, :m]  # [layers, nkv, m, hd]
        if self.vh is not None:
            self.vh[:, dst, :, :n] = self.vh[:, src, :, :n]  # [layers, nkv, n, hd]
        self.kt_valid[dst] = n

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, D] final-normed hidden states -> [N, V] fp32."""
        return ops.linear(h.float().contiguous(), self.lm_head)

    def logits_stats(self, h: torch.Tensor) -> tuple[torch.Tensor, LogitStats]:
        """``logits`` and their rows' argmax, logsumexp and finiteness, taken as the kernels write them."""
        y, amax, lse, finite = ops.linear_stats(h.float().contiguous(), self.lm_head)
        return y, LogitStats(amax, lse, finite, y, y._version)
