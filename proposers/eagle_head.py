"""EAGLE draft heads as torch modules: EAGLE-1 (:class:`EagleHead`) and EAGLE-3 (:class:`Eagle3Head`).

A head is one llama decoder layer fed, at position t, the target's feature of token t and the
embedding of token t+1; it predicts the feature of token t+1, whose logits give token t+2.

- EAGLE-1: ``x = fc(cat(embed(x_{t+1}), f_t))`` (fc 2D -> D with bias), then the decoder layer *without*
  an input norm (as published: layer 0 of the EAGLE code has no ``input_layernorm``). The output is a
  last-layer feature (after the target's final norm), so the target's LM head reads it directly.
- EAGLE-3: ``x = fc(cat(low, mid, high))`` (3D -> D, no bias) on the target's own features, or the
  head's previous output while drafting; attention reads ``cat(input_layernorm(embed), hidden_norm(x))``
  (2D wide), the residual stream is ``x``; ``lm_head(norm(out))`` scores a reduced draft vocabulary
  whose ids map to target ids as ``d + d2t[d]``.

Two forwards: :meth:`_Head.forward_train` over padded batches [B, T] with training-time test (TTT,
EAGLE-3 paper): step j feeds the head its own step j-1 outputs, and each query sees the true context
(step 0 keys at positions <= t) plus its own chain (the keys of steps 1..j at its index, the diagonal);
:meth:`_Head.forward_cached` over a flat batch of new pairs with a slot KV cache (one slot per sequence;
RoPE is applied before caching, so a slot may hold positions with holes, and rollback = set the length).

Knows nothing about proposers, requests or the target engine: embeddings and the EAGLE-1 LM head are
passed in as tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engine.config import rope_inv_freq
from specdec.heads.config import HeadConfig, eagle3_layers
from specdec.engine.kv_cache import SlotKVCache

__all__ = ["EagleHead", "Eagle3Head", "HeadConfig", "eagle3_layers", "sample_draft", "build_head"]


class _RMSNorm(nn.Module):
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


class _Head(nn.Module):
    """What EAGLE-1 and EAGLE-3 share: the decoder layer, RoPE, and both forwards."""

    def __init__(self, cfg: HeadConfig, attn_in: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn = _Attention(cfg, attn_in)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.inv_freq = rope_inv_freq(cfg.rope_config())  # [hd/2] float32; not a buffer: .to(dtype) keeps it fp32
        # training only: the target features are divided by this [F] per-dimension scale before fc (the
        # trainer folds it into fc.weight at export, so a saved head never has one)
        self.feat_scale: torch.Tensor | None = None
        self.cache: SlotKVCache | None = None

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


class EagleHead(_Head):
    """EAGLE-1: fc(cat(embed, feature)) -> decoder layer without input norm -> the target's LM head."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)

    def fuse(self, emb, feat):
        feat = feat.to(emb.dtype)
        if self.feat_scale is not None:
            feat = feat / self.feat_scale
        x = self.fc(torch.cat([emb, feat], -1))
        return x, x


class Eagle3Head(_Head):
    """EAGLE-3: fc(low, mid, high) -> decoder layer on cat(norm(embed), norm(x)) -> norm -> draft LM head."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, 2 * cfg.hidden_size)
        D = cfg.hidden_size
        V, Vd = cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size
        self.fc = nn.Linear(cfg.feature_size, D, bias=cfg.fc_bias)
        self.input_layernorm = _RMSNorm(D, cfg.rms_norm_eps)
        self.hidden_norm = _RMSNorm(D, cfg.rms_norm_eps)
        self.norm = _RMSNorm(D, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(D, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # draft id d -> target id d + d2t[d]
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))  # target id -> is in the draft vocab

    def fuse(self, emb, feat):
        if feat.shape[-1] != self.cfg.hidden_size:  # the target's fused layers; else the head's own output
            feat = feat.to(emb.dtype)
            x = self.fc(feat if self.feat_scale is None else feat / self.feat_scale)
        else:
            x = feat
        return x, torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], -1)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[N, D] head outputs -> [N, draft_vocab] float32 logits."""
        return self.lm_head(self.norm(out)).float()

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Make ``target_ids`` ([Vd] int64, ascending) the draft vocabulary: fills d2t and t2d."""
        ids = target_ids.to(self.d2t.device)
        if ids.numel() != self.d2t.numel():
            raise ValueError(f"Eagle3Head.set_vocab: {ids.numel()} ids for draft_vocab_size={self.d2t.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] int64 target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t


def build_head(cfg: HeadConfig) -> _Head:
    return EagleHead(cfg) if cfg.method == "eagle" else Eagle3Head(cfg)


def sample_draft(logits: torch.Tensor, st, gens: list[torch.Generator | None]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, V] draft logits -> (tokens [B] int64, q [B, V] float32, or None when every row is greedy).
    Greedy rows take the argmax; the others draw from q = the request's processed distribution by the
    exponential race with the request's generator (as the draft-model proposer does)."""
    from kernels.noise import draw_exponential

    logits = logits.float()
    if st.all_greedy:
        return logits.argmax(dim=-1), None
    q = st.to_probs(logits)  # greedy rows are one-hot at the argmax
    noise = draw_exponential(logits.shape[0], logits.shape[1], gens, device=logits.device)
    return (q / noise).argmax(dim=-1), q


def load_head(path, method: str | None = None) -> _Head:
    """An EAGLE-1 or EAGLE-3 head from a directory in the published layout (float32, eval mode). Attaches
    ``freq_ids`` (target ids by training frequency) when ``draft_vocab.safetensors`` sits beside it."""
    from pathlib import Path

    from specdec.heads import read_head

    cfg, sd, _ = read_head(path, method)
    head = build_head(cfg)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    vocab = Path(path).expanduser() / "draft_vocab.safetensors"
    if vocab.is_file():
        from safetensors.torch import load_file

        head.freq_ids = load_file(str(vocab))["ids"].long()
    return head.eval()
