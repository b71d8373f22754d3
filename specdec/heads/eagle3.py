"""The EAGLE-3 head: the network (:class:`Eagle3Head`, on :class:`specdec.heads.layers.DecoderHead`) and the
published checkpoint layout.

The published EAGLE-3 head layout (SafeAILab/EAGLE ``cnets.py``, ``LlamaForCausalLMEagle3``): config.json
(a LlamaConfig with num_hidden_layers=1, ``draft_vocab_size``, optionally ``target_hidden_size``) and
weights ``fc.weight`` [D, 3 Dt] (no bias), ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` [., 2D], ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` [Vd, D], ``d2t`` [Vd] int64
(target id = draft id + d2t[id]), ``t2d`` [V] bool; optionally ``embed_tokens.weight`` (ignored: the head
uses the target's embedding). Which target layers it fuses is not in the published config: the EAGLE-3
code takes the inputs of layers 2, L//2 and L-3; ``eagle3_hidden_layers`` (ours) overrides that.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec.heads.common import hf_config, hf_shape, read_dir, take, write_dir
from specdec.heads.config import HeadConfig
from specdec.heads.layers import DecoderHead, RMSNorm

__all__ = ["DraftVocab", "Eagle3Head", "read_eagle3", "write_eagle3"]


class Eagle3Head(DecoderHead):
    """EAGLE-3: fc(low, mid, high) -> decoder layer on cat(norm(embed), norm(x)) -> norm -> draft LM head."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, 2 * cfg.hidden_size)
        D = cfg.hidden_size
        V, Vd = cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size
        self.fc = nn.Linear(cfg.feature_size, D, bias=cfg.fc_bias)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
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

    @torch.inference_mode()
    def forward_logits(self, emb, feat, positions, slots, qlens, out_rows, logits_fn, tree_mask=None):
        """As ``DecoderHead.forward_logits``; with the native layer and ``logits_fn`` = this head's ``draft_logits``,
        the fuse, the layer and the draft LM head run in one call of the kernels (``NativeHeadLayer.step``)."""
        if (self.native is None or self.native.fused is None or logits_fn != self.draft_logits or self.cache is None
                or self.feat_scale is not None):  # a training-time feature scale: the torch path applies it
            return super().forward_logits(emb, feat, positions, slots, qlens, out_rows, logits_fn, tree_mask)
        cos, sin = self._rope_rows(positions)
        out, logits = self.native.step(emb, feat, cos, sin, slots, qlens, tree_mask, out_rows)
        return out.to(emb.dtype), logits

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


MID_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "post_attention_layernorm.weight", "input_layernorm.weight", "hidden_norm.weight")
TOP_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def read_eagle3(path: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor], dict]:
    """-> (HeadConfig, state dict in ``Eagle3Head``'s names, the raw config.json)."""
    cfg, sd = read_dir(path)
    mapping = {f"midlayer.{k}": k for k in MID_KEYS} | {k: k for k in TOP_KEYS}
    weights = take(sd, mapping, "EAGLE-3", str(path))
    shape = hf_shape(cfg)
    Vd = int(cfg.get("draft_vocab_size") or shape["vocab_size"])
    hc = HeadConfig(method="eagle3", fc_bias=False, draft_vocab_size=Vd,
                    target_hidden_size=cfg.get("target_hidden_size"),
                    hidden_layers=tuple(cfg.get("eagle3_hidden_layers") or ()), **shape)
    D, V = hc.hidden_size, hc.vocab_size
    want = {"fc.weight": (D, hc.feature_size), "lm_head.weight": (Vd, D), "d2t": (Vd,), "t2d": (V,)}
    for k, shp in want.items():
        if tuple(weights[k].shape) != shp:
            raise ValueError(f"EAGLE-3 head {path}: {k} is {tuple(weights[k].shape)}, expected {list(shp)} "
                             f"(hidden_size={D}, vocab_size={V}, draft_vocab_size={Vd})")
    weights["d2t"] = weights["d2t"].long()
    weights["t2d"] = weights["t2d"].bool()
    return hc, weights, cfg


def write_eagle3(path: str | Path, cfg: HeadConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, **extra_config) -> Path:
    """Write ``Eagle3Head.state_dict()`` in the published layout (float weights cast to ``dtype``)."""
    out = {}
    for k, v in state_dict.items():
        if k in MID_KEYS:
            out["midlayer." + k] = v.to(dtype)
        elif k in TOP_KEYS:
            out[k] = v if k in ("d2t", "t2d") else v.to(dtype)
    extra = dict(draft_vocab_size=cfg.draft_vocab_size or cfg.vocab_size, eagle3_hidden_layers=list(cfg.hidden_layers))
    if cfg.target_hidden_size:
        extra["target_hidden_size"] = cfg.target_hidden_size
    conf = hf_config(cfg, "LlamaForCausalLMEagle3", **extra, **extra_config)
    conf["torch_dtype"] = str(dtype).removeprefix("torch.")
    return write_dir(path, conf, out)


class DraftVocab:
    """An EAGLE-3 head's own reduced vocabulary, with the interface of ``heads.common.LMHeadRows``."""

    def __init__(self, logits, ids: torch.Tensor) -> None:
        self.logits = logits  # [N, D] head outputs -> [N, Vd] float32
        self.ids = ids  # [Vd] int64 target id of each draft id

    @property
    def size(self) -> int:
        return self.ids.numel()
