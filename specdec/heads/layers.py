"""The network EAGLE-1 and EAGLE-3 share: one llama decoder layer (:class:`DecoderHead`) with RoPE, its two
forwards, and the :class:`RMSNorm` both use. Each head (``eagle.py``, ``eagle3.py``) adds its ``fuse``.

Two forwards: :meth:`DecoderHead.forward_train` over padded batches [B, T] with training-time test (TTT,
EAGLE-3 paper): step j feeds the head its own step j-1 outputs, and each query sees the true context
(step 0 keys at positions <= t) plus its own chain (the keys of steps 1..j at its index, the diagonal);
:meth:`DecoderHead.forward_cached` over a flat batch of new pairs with a slot KV cache (one slot per sequence;
RoPE is applied before caching, so a slot may hold positions with holes, and rollback = set the length).

Knows nothing about checkpoint layouts, proposers, requests or the target engine.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engine.config import rope_inv_freq
from specdec.engine.kv_cache import SlotKVCache
from specdec.heads.config import HeadConfig

__all__ = ["DecoderHead", "RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int) -> None:
        super().__init__()
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE; x [..., heads, hd], cos/sin broadcastable [..., 1, hd] (sin signed, see below)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class DecoderHead(nn.Module):
    """What EAGLE-1 and EAGLE-3 share: the decoder layer, RoPE, and both forwards."""

    def __init__(self, cfg: HeadConfig, attn_in: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn = _Attention(cfg, attn_in)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.inv_freq = rope_inv_freq(cfg.rope_config())  # [hd/2] float32; not a buffer: .to(dtype) keeps it fp32
        # training only: the target features are divided by this [F] per-dimension scale before fc (the
        # trainer folds it into fc.weight at export, so a saved head never has one)
        self.feat_scale: torch.Tensor | None = None
        self.cache: SlotKVCache | None = None
        self.native = None  # a NativeHeadLayer (heads/native.py) once use_native() has packed the layer
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # native path: cos, sin [L, hd] by position

    # ---- the parts each head defines -------------------------------------------------------------
    def fuse(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x [.., D], attention input [.., attn_in]) from the embedding of the next token
        and a feature: the target's (width ``cfg.feature_size``) or the head's own output (width D)."""
        raise NotImplementedError

    # ---- shared math -----------------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [..., hd/2]
        cos, sin = ang.cos(), ang.sin()
        # signed sin: rotate_half(x) * sin == roll(x, hd/2) * cat(-sin, sin)
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N] -> 2 x [N, hd] fp32
        """``_cos_sin(positions, float32)`` read from a table over positions 0..L-1 (L = the cache's length, grown
        when a position passes it), built once: 47 -> 18 us per draft forward on the 2-core box (experiments/bench/step_ops.py)."""
        n = int(positions.max()) + 1 if positions.numel() else 0
        if self._rope_table is None or self._rope_table[0].shape[0] < n:
            L = max(n, self.cache.max_model_len if self.cache is not None else 0)
            self._rope_table = self._cos_sin(torch.arange(L, device=positions.device), torch.float32)
        return self._rope_table[0][positions], self._rope_table[1][positions]

    def _qkv(self, a: torch.Tensor, positions: torch.Tensor):
        """a [..., T, attn_in], positions broadcastable to [..., T] -> roped q [..., T, nh, hd], k, v [.., nkv, hd]."""
        c = self.cfg
        shape = a.shape[:-1]
        q = self.self_attn.q_proj(a).view(*shape, c.num_attention_heads, c.head_dim)
        k = self.self_attn.k_proj(a).view(*shape, c.num_key_value_heads, c.head_dim)
        v = self.self_attn.v_proj(a).view(*shape, c.num_key_value_heads, c.head_dim)
        cos, sin = self._cos_sin(positions, a.dtype)
        cos, sin = cos[..., None, :], sin[..., None, :]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    # ---- training: padded batches with training-time test ---------------------------------------
    def forward_train(self, emb: torch.Tensor, feat: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """emb [B, T + steps - 1, D]: embeddings of x_1, x_2, ... (index t holds the token after position t);
        feat [B, T, F]: the target's features f_0 .. f_{T-1}. Returns ``steps`` outputs [B, T, D]: step j
        at index t predicts the feature of position t+1+j, having fed its own step j-1 output there.
        Right padding needs no mask (causal attention never looks right)."""
        B, T = feat.shape[:2]
        c = self.cfg
        g = c.num_attention_heads // c.num_key_value_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        pos = torch.arange(T, device=feat.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=feat.device).tril()
        outs: list[torch.Tensor] = []
        diag_k: list[torch.Tensor] = []  # steps >= 1: keys at their own index, [B, nh, T, hd]
        diag_v: list[torch.Tensor] = []
        k0 = v0 = None
        prev = feat
        for j in range(steps):
            x, a = self.fuse(emb[:, j:j + T], prev)
            q, k, v = self._qkv(a, pos + j)  # [B, T, heads, hd]
            q = q.transpose(1, 2)  # [B, nh, T, hd]
            k = k.transpose(1, 2).repeat_interleave(g, dim=1)  # [B, nh, T, hd]
            v = v.transpose(1, 2).repeat_interleave(g, dim=1)
            if j == 0:
                k0, v0 = k, v
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                diag_k.append(k)
                diag_v.append(v)
                s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
                s0 = s0.masked_fill(~causal, float("-inf"))
                sd = torch.stack([(q * kk).sum(-1) for kk in diag_k], -1) * scale  # [B, nh, T, j]
                p = torch.cat([s0, sd], -1).softmax(-1)
                o = p[..., :T] @ v0 + (p[..., T:, None] * torch.stack(diag_v, -2)).sum(-2)
            o = o.transpose(1, 2).reshape(B, T, -1)
            prev = self._finish(x, o)
            outs.append(prev)
        return outs

    # ---- inference: flat batch over a slot KV cache ---------------------------------------------
    def init_cache(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> SlotKVCache:
        c = self.cfg
        self.cache = SlotKVCache(1, num_slots, c.num_key_value_heads, max_len, c.head_dim, dtype=dtype, device=device)
        return self.cache

    def use_native(self, weight_dtype: torch.dtype | None = None) -> str | None:
        """Run ``forward_cached``'s decoder layer through the CPU kernels in one call (heads/native.py), the
        projections packed in ``weight_dtype``; call after ``init_cache`` (and again after changing the weights:
        the layer packs a copy). -> None, or why it cannot (then the torch path stays)."""
        from specdec.heads.native import NativeHeadLayer, native_head_unsupported

        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}: call init_cache() before use_native()")
        why = native_head_unsupported(self, self.cache)
        self.native = None if why else NativeHeadLayer(self, self.cache, weight_dtype)
        return why

    @torch.inference_mode()
    def forward_cached(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor,
                       slots: list[int], qlens: list[int], tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """emb [N, D], feat [N, F or D], positions [N]: new pairs, sequence after sequence (``qlens`` each),
        appended to each sequence's slot; causal among a sequence's new pairs, or ``tree_mask`` [N, max(qlens)]
        bool (row t may see the j-th new pair of its sequence, as ``ForwardBatch.tree_mask``; the cached
        prefix is always visible) for drafting a tree. -> outputs [N, D]."""
        cache = self.cache
        if cache is None:
            raise RuntimeError(f"{type(self).__name__}: call init_cache() before forward_cached()")
        x, a = self.fuse(emb, feat)
        if self.native is not None:
            cos, sin = self._rope_rows(positions)
            return self.native.forward(x, a, cos, sin, slots, qlens, tree_mask).to(x.dtype)
        return self._forward_torch(x, a, positions, slots, qlens, tree_mask)

    @torch.inference_mode()
    def forward_logits(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, slots: list[int],
                       qlens: list[int], out_rows: list[int], logits_fn, tree_mask: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_cached``, then ``logits_fn`` ([n, D] -> [n, V'] float32) at the outputs of ``out_rows``
        -> (outputs [N, D], logits [len(out_rows), V']). A head with its own LM head may do both in one call."""
        out = self.forward_cached(emb, feat, positions, slots, qlens, tree_mask)
        return out, logits_fn(out[out_rows])

    def _forward_torch(self, x: torch.Tensor, a: torch.Tensor, positions: torch.Tensor, slots: list[int],
                       qlens: list[int], tree_mask: torch.Tensor | None) -> torch.Tensor:
        cache = self.cache
        q, k, v = self._qkv(a, positions)  # [N, heads, hd]
        c = self.cfg
        gqa = c.num_attention_heads != c.num_key_value_heads
        kc, vc = cache.k_layers[0], cache.v_layers[0]  # [S, nkv, M, hd]
        outs, t0 = [], 0
        for slot, n in zip(slots, qlens):
            start = cache.seq_len(slot)
            end = start + n
            if end > cache.max_model_len:
                raise ValueError(f"{type(self).__name__}: slot {slot} would hold {end} pairs > max_len "
                                 f"{cache.max_model_len}; build the proposer with a larger max_model_len")
            kc[slot, :, start:end] = k[t0:t0 + n].transpose(0, 1)
            vc[slot, :, start:end] = v[t0:t0 + n].transpose(0, 1)
            mask = None
            if tree_mask is not None:
                mask = torch.ones(n, end, dtype=torch.bool, device=q.device)
                mask[:, start:] = tree_mask[t0:t0 + n, :n]
            elif n > 1:  # causal among the new pairs, after a cached prefix every new pair sees
                mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril_(start)
            o = F.scaled_dot_product_attention(
                q[t0:t0 + n].transpose(0, 1)[None], kc[None, slot, :, :end], vc[None, slot, :, :end],
                attn_mask=mask, enable_gqa=gqa)  # [1, nh, n, hd]
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
            cache.lens[slot] = end
            t0 += n
        return self._finish(x, torch.cat(outs))
