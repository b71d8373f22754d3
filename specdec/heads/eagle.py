"""The EAGLE head family: the network (:class:`EagleHead`, and :class:`_Head`, what EAGLE-1 and EAGLE-3
share) and the published EAGLE-1 checkpoint layout; EAGLE-3's half is ``eagle3.py``.

EAGLE draft heads as torch modules: EAGLE-1 (:class:`EagleHead`) and EAGLE-3 (:class:`Eagle3Head`).

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

**EAGLE-1 checkpoint layout** (SafeAILab/EAGLE ``cnets1.py``): config.json (a LlamaConfig with
num_hidden_layers=1) and weights ``fc.weight`` [D, 2D], ``fc.bias`` [D], ``layers.0.self_attn.{q,k,v,o}_proj
.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``, and
optionally ``embed_tokens.weight`` (a copy of the target's; the head uses the target's own).
Layer 0 has no ``input_layernorm`` in the published code; a checkpoint that has one is refused.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engine.config import rope_inv_freq
from specdec.engine.kv_cache import SlotKVCache
from specdec.heads.common import LMHeadRows, hf_config, hf_shape, read_dir, take, write_dir
from specdec.heads.config import HeadConfig, eagle3_layers

__all__ = ["EagleHead", "HeadConfig", "PairSlots", "check_eagle_fits", "eagle3_layers", "head_pack_dtype", "random_head",
           "read_eagle1", "write_eagle1"]


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
        when a position passes it), built once: 47 -> 18 us per draft forward on the 2-core box (experiments/bench_step_ops.py)."""
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

    @torch.inference_mode()
    def forward_logits(self, emb, feat, positions, slots, qlens, out_rows, logits_fn, tree_mask=None):
        """As ``_Head.forward_logits``; with the native layer and ``logits_fn`` = an ``LMHeadRows.logits`` packed
        for the kernels, the fuse, the layer and the LM head rows run in one call (``NativeHeadLayer.step_eagle1``)."""
        lm = getattr(getattr(logits_fn, "__self__", None), "_native", None)
        if (lm is None or self.native is None or self.native.fc1 is None or self.cache is None
                or self.feat_scale is not None or getattr(logits_fn, "__func__", None) is not LMHeadRows.logits):
            return super().forward_logits(emb, feat, positions, slots, qlens, out_rows, logits_fn, tree_mask)
        cos, sin = self._rope_rows(positions)
        out, logits = self.native.step_eagle1(emb, feat, cos, sin, slots, qlens, tree_mask, out_rows, lm)
        return out.to(emb.dtype), logits


LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight")


def read_eagle1(path: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor], dict]:
    """-> (HeadConfig, state dict in ``EagleHead``'s names, the raw config.json)."""
    cfg, sd = read_dir(path)
    if "layers.0.input_layernorm.weight" in sd:
        raise ValueError(f"EAGLE-1 head {path}: has layers.0.input_layernorm.weight, which the published EAGLE-1 "
                         "layer does not have; this is not the EAGLE-1 layout")
    mapping = {f"layers.0.{k}": k for k in LAYER_KEYS} | {"fc.weight": "fc.weight"}
    if "fc.bias" in sd:
        mapping["fc.bias"] = "fc.bias"
    weights = take(sd, mapping, "EAGLE-1", str(path))
    hc = HeadConfig(method="eagle", fc_bias="fc.bias" in sd, **hf_shape(cfg))
    D = hc.hidden_size
    if tuple(weights["fc.weight"].shape) != (D, 2 * D):
        raise ValueError(f"EAGLE-1 head {path}: fc.weight is {tuple(weights['fc.weight'].shape)}, expected "
                         f"[{D}, {2 * D}] for hidden_size={D}")
    return hc, weights, cfg


def write_eagle1(path: str | Path, cfg: HeadConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, **extra_config) -> Path:
    """Write ``EagleHead.state_dict()`` in the published layout (weights cast to ``dtype``)."""
    out = {("layers.0." + k if k in LAYER_KEYS else k): v.to(dtype) for k, v in state_dict.items()
           if k in LAYER_KEYS or k.startswith("fc.")}
    conf = hf_config(cfg, "LlamaForCausalLM", bias=cfg.fc_bias, **extra_config)
    conf["torch_dtype"] = str(dtype).removeprefix("torch.")
    return write_dir(path, conf, out)


def random_head(target_cfg, method: str, seed: int = 0):
    """A seeded random EAGLE-1 / EAGLE-3 head shaped like the target (debug runs, smoke tests): EAGLE-3 gets
    a 256-token draft vocabulary; ``freq_ids`` is id order (there are no training frequencies)."""
    from specdec.heads.eagle3 import Eagle3Head

    torch.manual_seed(seed)
    if method == "eagle3":
        vd = min(target_cfg.vocab_size, 256)
        head = Eagle3Head(HeadConfig.for_target(target_cfg, method, draft_vocab_size=vd))
        head.set_vocab(torch.arange(vd))
    else:
        head = EagleHead(HeadConfig.for_target(target_cfg, method))
    head.freq_ids = torch.arange(target_cfg.vocab_size)
    return head


def check_eagle_fits(cfg: HeadConfig, hidden_size: int, vocab_size: int, method: str, name: str) -> None:
    """Refuse a head that was not trained for this target (or is of the other EAGLE kind), naming both."""
    for key, have in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if getattr(cfg, key) != have:
            raise ValueError(f"head {name} has {key}={getattr(cfg, key)} but the target has {key}={have}; a head "
                             "fits only the model it was trained on")
    if cfg.method != method:
        raise ValueError(f"head {name} is an {cfg.method!r} head; use method={'eagle3' if cfg.method == 'eagle3' else 'eagle'}")


class PairSlots:
    """Which pairs each sequence's head KV slot holds: the pair of token i (feature of token i-1, embedding
    of token i) by token index and id, in feeding order (ascending). Holes are allowed."""

    def __init__(self, cache: SlotKVCache) -> None:
        self.cache = cache
        self.slot_of: dict[int, int] = {}  # seq_id -> head KV slot
        self.idx: dict[int, list[int]] = {}  # seq_id -> token index of each pair
        self.tok: dict[int, list[int]] = {}  # seq_id -> token id of each pair

    def slot(self, seq_id: int) -> int:
        if seq_id not in self.slot_of:
            self.slot_of[seq_id] = self.cache.allocate()
            self.idx[seq_id], self.tok[seq_id] = [], []
        return self.slot_of[seq_id]

    def cut(self, seq_id: int, n: int) -> None:
        """Keep the first ``n`` pairs."""
        idx = self.idx[seq_id]
        if n < len(idx):
            self.cache.rollback(self.slot_of[seq_id], n)
            del idx[n:], self.tok[seq_id][n:]

    def keep_before(self, seq_id: int, first: int, tokens: list[int]) -> None:
        """Keep the pairs of tokens before index ``first`` that still match ``tokens`` (a missed
        ``verified`` costs a recompute, never a pair of the wrong token)."""
        idx, tok = self.idx[seq_id], self.tok[seq_id]
        n = bisect.bisect_left(idx, first)
        if tok[:n] != [tokens[i] for i in idx[:n]]:
            n = next(j for j in range(n) if tok[j] != tokens[idx[j]])
        self.cut(seq_id, n)

    def add(self, seq_id: int, index: int, token: int) -> None:
        self.idx[seq_id].append(index)
        self.tok[seq_id].append(token)

    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        if seq_id in self.idx:
            self.cut(seq_id, bisect.bisect_left(self.idx[seq_id], num_valid_tokens))

    def free(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        self.idx.pop(seq_id, None)
        self.tok.pop(seq_id, None)
        if slot is not None:
            self.cache.free(slot)

    def snapshot(self, seq_ids: list[int]) -> dict[int, int | None]:
        """Pairs in each sequence's slot (None: no slot)."""
        return {s: len(self.idx[s]) if s in self.slot_of else None for s in seq_ids}

    def restore(self, snapshot: dict[int, int | None]) -> None:
        for s, n in snapshot.items():
            if n is None:
                self.free(s)
            elif s in self.slot_of:
                self.cut(s, min(n, self.cache.seq_len(self.slot_of[s])))


def head_pack_dtype(name: str) -> torch.dtype | None:
    """The dtype a head's projections are packed in for the CPU kernels: ``float32``, ``bfloat16``, or
    ``auto`` = bfloat16 where the x86 kernels run (half the bytes a draft step reads: AVX512_BF16 multiplies
    bf16 natively, AVX2 widens it in registers), else the head's own. None = the head's own dtype. A
    draft's precision changes only its q, which verification accounts for: the output stays the target's.
    On AVX2 (2026-11-25, experiments/LOG.md) bf16 cut EAGLE-3's propose from 11.4 to 10.0 ms with the
    replayed tau unchanged to the last digit (EAGLE-1: 1.824 -> 1.826)."""
    if name == "auto":
        from specdec.engine.cpu.build import choose_isa, load

        return torch.bfloat16 if load()[0] is not None and choose_isa() in ("avx512bf16", "avx2") else None
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"options.head_dtype={name!r}; choose float32, bfloat16 or auto")
    return dtypes[name]
