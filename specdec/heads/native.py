"""`NativeHeadLayer`: an EAGLE head's decoder layer (EAGLE-1 or EAGLE-3) run by the CPU kernels in one call.

The torch path of ``DecoderHead.forward_cached`` costs ~20 small ops per head forward (three projections, RoPE,
one SDPA per sequence with its mask, the output projection, a norm, the MLP): about 2 ms on the project's
2-core CPU for a few rows whose weights take ~0.3 ms to read (experiments/LOG.md, 2026-11-26). Here the
head's ``fuse`` still runs in torch (it differs between the families: EAGLE-1's attention input is the
residual stream itself, EAGLE-3's is ``cat(norm(embed), norm(x))``, 2D wide), then ``sd_layer_from`` does
the rest in one call: q/k/v as one packed product, RoPE and the cache write, attention over the slot cache
(causal, or the draft tree's mask), the output projection, the post-attention norm and the MLP.

The head's KV cache stays its ``SlotKVCache`` (fp32, one layer), so rollback and slot bookkeeping are the
torch path's. The kernels also keep K in blocks (``kernels.cpp``, ``SdCache.kt``), valid up to
``kt_valid`` per slot; the head's cache is only ever cut back and appended to (``PairSlots``), never copied
within, so every forward first lowers ``kt_valid`` to the slot's length and the keys below it are current.

The weights are packed in ``weight_dtype`` (bf16 halves the bytes a draft step reads); activations and the
cache are fp32. A draft head's numerics change only its proposals, never the output, which verification
decides. Knows nothing about proposers or the target.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from specdec.engine.cpu import ops
from specdec.engine.cpu.ops import NativeLinear, NativeWeight, SdLayer, SdModel, fptr
from specdec.engine.cpu.stack import Scratch, sd_rows

__all__ = ["NativeHeadLayer", "native_head_unsupported"]


def native_head_unsupported(head, cache) -> str | None:
    """Why ``NativeHeadLayer`` cannot run ``head`` over ``cache`` (None when it can)."""
    if ops.lib() is None:
        from specdec.engine.cpu.build import status

        return status()
    k = cache.k_layers[0]
    if k.dtype != torch.float32 or k.device.type != "cpu":
        return f"head KV cache is {k.dtype} on {k.device} (the kernels keep an fp32 CPU cache)"
    if head.cfg.head_dim > 1024:
        return f"head_dim={head.cfg.head_dim} > 1024"
    return None


def _weight(lin, dtype: torch.dtype | None) -> torch.Tensor:
    """[N, K] weight of an ``nn.Linear`` or of a ``NativeLinear`` (as packed), in ``dtype`` when given."""
    w = lin.nw.w if isinstance(lin, NativeLinear) else lin.weight.detach()
    return w.to(dtype) if dtype is not None else w


class NativeHeadLayer:
    def __init__(self, head, cache, weight_dtype: torch.dtype | None = None) -> None:
        """head: an ``EagleHead`` or ``Eagle3Head`` (``specdec.heads``); cache: its one-layer SlotKVCache (fp32);
        weight_dtype: the packing dtype of the projections (None: the weights' own)."""
        why = native_head_unsupported(head, cache)
        if why:
            raise RuntimeError(f"NativeHeadLayer: {why}")
        c, at, ml = head.cfg, head.self_attn, head.mlp
        dt = weight_dtype
        self.cfg = c
        self.cache = cache
        self.model = SdModel(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, c.rms_norm_eps)  # fmt: skip
        wq, wk, wv = (_weight(m, dt) for m in (at.q_proj, at.k_proj, at.v_proj))
        common = torch.promote_types(torch.promote_types(wq.dtype, wk.dtype), wv.dtype)
        self.wqkv = NativeWeight(torch.cat([wq.to(common), wk.to(common), wv.to(common)]).contiguous())
        self.wo = NativeWeight(_weight(at.o_proj, dt).contiguous())
        wg, wu = _weight(ml.gate_proj, dt), _weight(ml.up_proj, dt)
        self.w13 = NativeWeight(torch.cat([wg, wu.to(wg.dtype)]).contiguous())
        self.w2 = NativeWeight(_weight(ml.down_proj, dt).contiguous())
        self.ffn_norm = head.post_attention_layernorm.weight.detach().float().contiguous()
        self.attn_in = self.wqkv.shape[1]  # EAGLE-1: D; EAGLE-3: 2D
        S = cache.k_layers[0].shape[0]
        # K in blocks of VL keys (kernels.cpp), fp32 whatever the weights: the head's attention stays fp32, as its torch
        # reference (draft_tree_ref) computes it (one layer: its context's bytes are a thirtieth of the target's)
        self.kt, self.vh = ops.attention_copies(tuple(cache.k_layers[0].shape), torch.float32)
        self.kt_valid = np.zeros(S, dtype=np.int64)
        sc = ops.sd_cache(cache.k_layers[0], cache.v_layers[0], self.kt, self.vh)
        self.layer = SdLayer(None, self.wqkv.desc, self.wo.desc, fptr(self.ffn_norm), self.w13.desc, self.w2.desc, sc)
        self.fused = _Eagle3Parts.of(head, dt)  # EAGLE-3: fuse + layer + draft LM head in one call (step)
        # EAGLE-1: fc over cat(emb, feat), the layer and the target's LM head rows in one call (step_eagle1)
        self.fc1 = _packed(head.fc, dt) if self.fused is None and self.attn_in == c.hidden_size and \
            head.fc.in_features == 2 * c.hidden_size and head.feat_scale is None else None
        self.scratch = Scratch(c, max(self.attn_in, self.fused.fc.shape[1] if self.fused else 0,
                                      2 * c.hidden_size if self.fc1 is not None else 0))

    def step(
        self,
        emb: torch.Tensor,  # [N, D] embeddings of the new pairs' tokens
        feat: torch.Tensor,  # [N, fc in] the target's fused layers, or [N, D] the head's own outputs
        cos: torch.Tensor,  # [N, hd]
        sin: torch.Tensor,  # [N, hd] signed
        slots: list[int],
        qlens: list[int],
        tree_mask: torch.Tensor | None,  # [N, max(qlens)] bool, or None = causal among the new pairs
        out_rows: list[int],  # rows whose draft logits to return
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-3 only (``self.fused``): ``fuse``, the layer and ``draft_logits`` in one call of the kernels
        -> (outputs [N, D] fp32, draft logits [len(out_rows), draft_vocab] fp32 at ``out_rows``)."""
        f = self.fused
        N, D = emb.shape
        from_target = feat.shape[-1] != D
        x = torch.empty(N, D) if from_target else feat.float().contiguous().clone()
        feat = feat.float().contiguous() if from_target else None
        emb = emb.float().contiguous()
        a = torch.empty(N, 2 * D)
        rows, logits, starts, r, _hold = self._step_args("step", N, out_rows, f.lm.shape[0], slots, qlens, cos, sin,
                                                         tree_mask)
        ops.lib().sd_eagle3_step(
            ctypes.byref(self.model), ctypes.byref(self.layer), ctypes.byref(r),
            ctypes.byref(f.fc.desc) if from_target else None, fptr(feat), fptr(emb), fptr(f.w_in), fptr(f.w_hid),
            fptr(a), fptr(x), rows, len(out_rows),
            fptr(f.w_out), ctypes.byref(f.lm.desc), fptr(logits), ctypes.byref(self.scratch(N)),
        )  # fmt: skip
        self._done(slots, starts, qlens)
        return x, logits

    def step_eagle1(
        self,
        emb: torch.Tensor,  # [N, D] embeddings of the new pairs' tokens
        feat: torch.Tensor,  # [N, D] the target's features, or the head's own outputs
        cos: torch.Tensor,  # [N, hd]
        sin: torch.Tensor,  # [N, hd] signed
        slots: list[int],
        qlens: list[int],
        tree_mask: torch.Tensor | None,  # [N, max(qlens)] bool, or None = causal among the new pairs
        out_rows: list[int],  # rows whose draft logits to return
        lm: NativeWeight,  # the target's LM head rows of the draft vocabulary, packed ([Vd, D])
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-1 only (``self.fc1``): ``fuse``, the layer and the LM head rows in one call of the kernels
        -> (outputs [N, D] fp32, logits [len(out_rows), Vd] fp32 at ``out_rows``)."""
        N, D = emb.shape
        if feat.shape != (N, D):
            raise ValueError(f"NativeHeadLayer.step_eagle1: feat is {tuple(feat.shape)}, expected [{N}, {D}]")
        x, a = torch.empty(N, D), torch.empty(N, 2 * D)
        feat, emb = feat.float().contiguous(), emb.float().contiguous()  # held here while the kernel reads them
        rows, logits, starts, r, _hold = self._step_args("step_eagle1", N, out_rows, lm.shape[0], slots, qlens, cos,
                                                         sin, tree_mask)
        ops.lib().sd_eagle1_step(
            ctypes.byref(self.model), ctypes.byref(self.layer), ctypes.byref(r), ctypes.byref(self.fc1.desc),
            fptr(feat), fptr(emb), fptr(a), fptr(x), rows, len(out_rows),
            ctypes.byref(lm.desc), fptr(logits), ctypes.byref(self.scratch(N)),
        )  # fmt: skip
        self._done(slots, starts, qlens)
        return x, logits

    def _step_args(self, who: str, N: int, out_rows: list[int], n_logits: int, slots: list[int], qlens: list[int],
                   cos: torch.Tensor, sin: torch.Tensor, tree_mask: torch.Tensor | None) -> tuple:
        """What a fused draft step passes besides its weights: (the out rows as a C array, logits [len(out_rows),
        n_logits] to fill, each slot's start, the ``SdRows``, the arrays it points into)."""
        if out_rows and not (0 <= min(out_rows) and max(out_rows) < N):
            raise ValueError(f"NativeHeadLayer.{who}: out_rows {out_rows} outside the {N} new pairs")
        rows = (ctypes.c_int64 * len(out_rows))(*out_rows)
        logits = torch.empty(len(out_rows), n_logits)
        starts = self._start(slots, qlens)
        r, hold = sd_rows(N, slots, starts, qlens, cos.float().contiguous(), sin.float().contiguous(), tree_mask,
                          self.kt_valid)
        return rows, logits, starts, r, hold

    def _start(self, slots: list[int], qlens: list[int]) -> list[int]:
        """Each slot's length before the new pairs, checked against the cache; lowers ``kt_valid`` to it."""
        cache = self.cache
        starts = [cache.seq_len(s) for s in slots]
        for s, st, n in zip(slots, starts, qlens):
            if st + n > cache.max_model_len:
                raise ValueError(f"head: slot {s} would hold {st + n} pairs > max_len {cache.max_model_len}; build "
                                 "the proposer with a larger max_model_len")
            self.kt_valid[s] = min(int(self.kt_valid[s]), st)  # cut back since the last forward (rollback)
        return starts

    def _done(self, slots: list[int], starts: list[int], qlens: list[int]) -> None:
        for s, st, n in zip(slots, starts, qlens):
            self.cache.lens[s] = st + n
            self.kt_valid[s] = st + n  # the call blocked every key it read

    def __deepcopy__(self, memo) -> None:
        """A copied head has its own cache, which this layer's descriptors do not point at: the copy runs the
        torch path (call its ``use_native()`` again to pack it)."""
        return None

    def forward(
        self,
        x: torch.Tensor,  # [N, D] residual stream after fc
        a: torch.Tensor,  # [N, attn_in] attention input
        cos: torch.Tensor,  # [N, hd] at each pair's position
        sin: torch.Tensor,  # [N, hd] signed (rope(x) = x cos + roll(x, hd/2) sin)
        slots: list[int],
        qlens: list[int],
        tree_mask: torch.Tensor | None,  # [N, max(qlens)] bool, or None = causal among the new pairs
    ) -> torch.Tensor:
        """Append the N new pairs to their slots and run the layer -> its output [N, D] fp32."""
        N = x.shape[0]
        starts = self._start(slots, qlens)
        out = x.float().contiguous().clone()
        a = out if a is x else a.float().contiguous()
        r, _hold = sd_rows(N, slots, starts, qlens, cos.float().contiguous(), sin.float().contiguous(), tree_mask,
                           self.kt_valid)
        ops.lib().sd_layer_from(ctypes.byref(self.model), ctypes.byref(self.layer), ctypes.byref(r), fptr(out), fptr(a),
                                ctypes.byref(self.scratch(N)))
        self._done(slots, starts, qlens)
        return out


class _Eagle3Parts:
    """What ``NativeHeadLayer.step`` reads besides the layer: an EAGLE-3 head's fc and draft LM head (packed) and
    its three norms (fp32 copies)."""

    def __init__(self, head, dtype: torch.dtype | None) -> None:
        self.fc = _packed(head.fc, dtype)
        self.lm = _packed(head.lm_head, dtype)
        self.w_in, self.w_hid, self.w_out = (n.weight.detach().float().contiguous()
                                            for n in (head.input_layernorm, head.hidden_norm, head.norm))

    @classmethod
    def of(cls, head, dtype: torch.dtype | None) -> _Eagle3Parts | None:
        """The parts of an EAGLE-3 head (None for any other head, or while it trains with a feature scale)."""
        if not all(hasattr(head, n) for n in ("hidden_norm", "lm_head", "norm", "fc")) or head.feat_scale is not None:
            return None
        return cls(head, dtype)


def _packed(lin, dtype: torch.dtype | None) -> NativeWeight:
    """The ``NativeWeight`` of an ``nn.Linear`` or a ``NativeLinear`` (its own when it is packed in ``dtype``)."""
    if isinstance(lin, NativeLinear) and (dtype is None or lin.nw.w.dtype == dtype):
        return lin.nw
    bias = lin.nw.bias if isinstance(lin, NativeLinear) else lin.bias
    return NativeWeight(_weight(lin, dtype).contiguous(), None if bias is None else bias.detach())
