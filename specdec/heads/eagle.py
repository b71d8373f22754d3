"""The EAGLE head family: the EAGLE-1 network (:class:`EagleHead`, on ``layers.py``'s :class:`DecoderHead`, what
EAGLE-1 and EAGLE-3 share) and the published EAGLE-1 checkpoint layout; EAGLE-3's half is ``eagle3.py``.

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

Two forwards (``layers.py``): :meth:`DecoderHead.forward_train` over padded batches with training-time test,
:meth:`DecoderHead.forward_cached` over a flat batch of new pairs with a slot KV cache.

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
from pathlib import Path

import torch
from torch import nn

from specdec.engine.kv_cache import SlotKVCache
from specdec.heads.common import LMHeadRows, hf_config, hf_shape, read_dir, take, write_dir
from specdec.heads.config import HeadConfig, eagle3_layers
from specdec.heads.eagle3 import Eagle3Head
from specdec.heads.layers import DecoderHead

__all__ = ["EagleHead", "HeadConfig", "PairSlots", "check_eagle_fits", "eagle3_layers", "head_pack_dtype", "random_head",
           "read_eagle1", "write_eagle1"]


class EagleHead(DecoderHead):
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
        """As ``DecoderHead.forward_logits``; with the native layer and ``logits_fn`` = an ``LMHeadRows.logits`` packed
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
