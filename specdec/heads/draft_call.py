"""The EAGLE draft tree of one step in one call: the contract, its torch reference, and the native call.

EAGLE-2's dynamic tree (proposers/dynamic_tree.py) over an EAGLE-1 or EAGLE-3 head, after the catch-up has fed the
committed pairs and given the head's output and draft logits at each sequence's pending pair. For B sequences,
k = min(topk, Vd) children per node, C = k + (depth - 1) k^2 candidates and N = min(budget, C) kept nodes:

inputs
    last         [B, D] fp32     the head's output at each pending pair (the catch-up's last row)
    root_logits  [B, Vd] fp32    its draft logits: the token after the pending token
    slots        [B]             each sequence's head KV slot; its length (``starts``) = the committed pairs
    pos0         [B]             the pending pair's RoPE position (a node at depth d sits at pos0 + d)
    shape        TreeShape       depth, topk, budget
    d2t          [Vd] int64      target id of each draft id (None: the draft vocabulary is the target's)
outputs (:class:`DraftTree`)
    tokens       [B, N] int64    target ids, nodes in creation order (depth-major, a parent before its children)
    parents      [B, N] int64    index of the parent among the kept nodes, -1 = child of the pending token
    logprobs     [B, N] fp32     cumulative draft log-prob of the path to the node
    rank         [B, N] int64    0 = best logprob; ties: the earlier-made first (``graft_within_budget`` reads it)
    num_nodes    [B] int64       N in every row

What it does (each depth): depth 1 = the top k of log_softmax(root_logits). For d = 2..depth the k frontier nodes
of depth d-1 are appended to the head's slot as new pairs (embedding of the node's token, the head's output at its
parent) at cache index start + (d - 2) k + i, each attending to the cached prefix and to its ancestors among the
appended nodes; their k x k children are scored parent + log-prob, and the k best (ties: the earlier-made) form the
next frontier. Then the N best candidates of all depths by a stable descending sort, kept in creation order (so
every kept node's ancestors are kept: a child's score is its parent's plus a log-prob <= 0). This is what
``build_ranked_tree`` + ``head_expand`` compute, except that each node is fed once instead of re-feeding every
frontier so far at each depth: (depth - 1) k rows in all instead of k (1 + 2 + ... + (depth - 1)).

The head's KV cache: the call writes the keys and values of the (depth - 1) k fed nodes past each slot's length
and leaves the length as it was, i.e. it ends as EagleProposer's rollback to the committed pairs; the next catch-up
overwrites them.

:func:`draft_tree_ref` is the readable torch reference over plain weights (:class:`DraftWeights`);
:class:`NativeDraftTree` runs the same contract in one call of the CPU kernels (``sd_eagle_tree``,
``specdec/engine/cpu/csrc/draft_tree.h``); ``tests/heads/test_draft_call.py`` compares them. Knows nothing about
proposers, requests, n-gram branches or the target engine.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from specdec.engine.cpu import ops
from specdec.engine.cpu.ops import WDTYPES, NativeWeight, SdDraftHead, SdWeight, fptr

if TYPE_CHECKING:  # a shape is any object with depth, topk, budget (heads sit below spec_decode)
    from specdec.spec_decode.proposer import TreeShape

__all__ = ["DraftTree", "DraftWeights", "NativeDraftTree", "draft_tree_ref"]

_ip = ctypes.POINTER(ctypes.c_int64)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64 target ids
    parents: torch.Tensor  # [B, N] int64 kept index of the parent, -1 = child of the pending token
    logprobs: torch.Tensor  # [B, N] float32 cumulative draft log-prob
    rank: torch.Tensor  # [B, N] int64 0 = best; ties: earlier-made first
    num_nodes: torch.Tensor  # [B] int64


@dataclass
class DraftWeights:
    """An EAGLE head's weights as plain fp32 tensors (the values the kernels read, unpacked), for the reference."""

    kind: int  # 1 = EAGLE-1, 3 = EAGLE-3 (see sd_eagle_tree's SdDraftHead)
    wqkv: torch.Tensor  # [(nh + 2 nkv) hd, attn_in]
    wo: torch.Tensor  # [D, nh hd]
    ffn_norm: torch.Tensor  # [D]
    w13: torch.Tensor  # [2I, D] gate then up
    w2: torch.Tensor  # [D, I]
    lm: torch.Tensor  # [Vd, D] draft LM head rows
    emb: torch.Tensor  # [Vd, D] the target's embedding of each draft id
    cos: torch.Tensor  # [npos, hd] RoPE by position
    sin: torch.Tensor  # [npos, hd] signed
    nh: int
    nkv: int
    hd: int
    eps: float
    fc: torch.Tensor | None = None  # EAGLE-1 [D, 2D]
    fc_bias: torch.Tensor | None = None  # EAGLE-1 [D]
    w_in: torch.Tensor | None = None  # EAGLE-3 [D] norm of the embedding
    w_hid: torch.Tensor | None = None  # EAGLE-3 [D] norm of the head's own output
    w_out: torch.Tensor | None = None  # EAGLE-3 [D] norm before the LM head


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _head_rows(w: DraftWeights, emb: torch.Tensor, feat: torch.Tensor, pos: int, kc: torch.Tensor, vc: torch.Tensor,
               at: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head on n new pairs of one sequence: emb, feat [n, D]; keys written to kc/vc [nkv, L, hd] at [at, at + n);
    mask [n, at + n] bool the keys each row sees -> (outputs [n, D], draft logits [n, Vd])."""
    n = emb.shape[0]
    if w.kind == 3:
        x = feat
        a = torch.cat([_rms(emb, w.w_in, w.eps), _rms(x, w.w_hid, w.eps)], -1)  # [n, 2D]
    else:
        x = a = F.linear(torch.cat([emb, feat], -1), w.fc, w.fc_bias)  # [n, D]
    q, k, v = F.linear(a, w.wqkv).split([w.nh * w.hd, w.nkv * w.hd, w.nkv * w.hd], -1)
    q, k, v = q.view(n, w.nh, w.hd), k.view(n, w.nkv, w.hd), v.view(n, w.nkv, w.hd)
    cos, sin = w.cos[pos], w.sin[pos]  # [hd] each: every row of a depth sits at one position
    q, k = (t * cos + t.roll(w.hd // 2, -1) * sin for t in (q, k))
    kc[:, at:at + n], vc[:, at:at + n] = k.transpose(0, 1), v.transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :at + n], vc[None, :, :at + n],
                                       attn_mask=mask, enable_gqa=w.nh != w.nkv)  # [1, nh, n, hd]
    x = x + F.linear(o[0].transpose(0, 1).reshape(n, -1), w.wo)
    g, u = F.linear(_rms(x, w.ffn_norm, w.eps), w.w13).chunk(2, -1)
    x = x + F.linear(F.silu(g) * u, w.w2)
    return x, F.linear(_rms(x, w.w_out, w.eps) if w.kind == 3 else x, w.lm)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best of scores [n] (ties: the lower index first), in that order."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


@torch.inference_mode()
def draft_tree_ref(w: DraftWeights, k_cache: torch.Tensor,  # [S, nkv, L, hd] the head's keys (written past starts)
                   v_cache: torch.Tensor,  # [S, nkv, L, hd]
                   last: torch.Tensor, root_logits: torch.Tensor,  # [B, D], [B, Vd]
                   slots: list[int], starts: list[int], pos0: list[int], shape: TreeShape,
                   d2t: torch.Tensor | None = None) -> DraftTree:
    """The contract of the module docstring in plain torch, one sequence at a time."""
    B, Vd = root_logits.shape
    k = min(shape.topk, Vd)
    rows = []
    for b in range(B):
        lp = torch.log_softmax(root_logits[b].float(), -1)
        top = _top(lp, k)
        tok, par, sc = top.tolist(), [-1] * k, [lp[top]]  # per candidate id: draft id, parent; scores by depth
        front, out = list(range(k)), {-1: last[b].float()}  # frontier candidate ids; head output per fed candidate
        fed: list[int] = []  # candidate ids in feeding order (= their cache index past starts[b])
        for d in range(2, shape.depth + 1):
            fed += front
            F_ = len(fed)
            anc = torch.zeros(F_, F_, dtype=torch.bool)  # [F, F] ancestor-or-self among the fed nodes
            for i, c in enumerate(fed):
                if par[c] >= 0:
                    anc[i] = anc[fed.index(par[c])]
                anc[i, i] = True
            mask = torch.cat([torch.ones(k, starts[b], dtype=torch.bool), anc[F_ - k:]], 1)  # [k, start + F]
            feat = torch.stack([out[par[c]] for c in front])  # [k, D]
            o, logits = _head_rows(w, w.emb[torch.tensor([tok[c] for c in front])], feat, pos0[b] + d - 1,
                                   k_cache[slots[b]], v_cache[slots[b]], starts[b] + F_ - k, mask)
            out.update({c: o[i] for i, c in enumerate(front)})
            lps = torch.log_softmax(logits.float(), -1)  # [k, Vd]
            kids = torch.stack([_top(r, k) for r in lps])  # [k, k] draft ids, best first
            child_sc = (torch.cat(sc)[torch.tensor(front)][:, None] + lps.gather(1, kids)).reshape(-1)  # [k k]
            C0 = len(tok)
            tok += kids.reshape(-1).tolist()
            par += [f for f in front for _ in range(k)]
            sc.append(child_sc)
            front = [C0 + i for i in sorted(_top(child_sc, k).tolist())]
        scores = torch.cat(sc)  # [C] in creation order
        order = _top(scores, scores.numel())
        N = min(shape.budget, scores.numel())
        keep = sorted(order[:N].tolist())
        at = {c: i for i, c in enumerate(keep)}
        rank = {c: r for r, c in enumerate(order[:N].tolist())}
        if any(par[c] >= 0 and par[c] not in at for c in keep):
            raise RuntimeError("draft_tree_ref: a kept node's parent was pruned (NaN draft log-probs?)")
        rows.append(([tok[c] for c in keep], [at[par[c]] if par[c] >= 0 else -1 for c in keep],
                     scores[keep], [rank[c] for c in keep]))
    tokens = torch.tensor([r[0] for r in rows], dtype=torch.long)
    return DraftTree(tokens if d2t is None else d2t.cpu()[tokens], torch.tensor([r[1] for r in rows], dtype=torch.long),
                     torch.stack([r[2] for r in rows]), torch.tensor([r[3] for r in rows], dtype=torch.long),
                     torch.full((B,), len(rows[0][0]), dtype=torch.long))


class NativeDraftTree:
    """The contract in one call of the CPU kernels, over a head whose decoder layer is packed
    (``head.native``, a ``NativeHeadLayer``). ``emb``: the target's embedding of each draft id [Vd, D] (fp32, bf16 or
    fp16; read as it is, k rows per depth, so it is not packed and may be a tensor the caller already holds);
    ``lm``: the draft LM head rows, packed (EAGLE-3: None = the head's own)."""

    def __init__(self, head, emb: torch.Tensor, lm: NativeWeight | None = None) -> None:
        layer = head.native
        if layer is None or ops.lib() is None:
            raise RuntimeError("NativeDraftTree: the head's layer is not packed for the CPU kernels; call "
                               "head.use_native() first (or draft with the torch path)")
        if head.feat_scale is not None:
            raise RuntimeError("NativeDraftTree: the head has a training-time feature scale; export it first")
        if layer.fused is not None:  # EAGLE-3
            kind, fc, lm = 3, None, layer.fused.lm
            norms = (layer.fused.w_in, layer.fused.w_hid, layer.fused.w_out)
        elif layer.fc1 is not None:
            if lm is None:
                raise ValueError("NativeDraftTree: an EAGLE-1 head scores with the target's LM head rows; pass lm")
            kind, fc, norms = 1, layer.fc1, (None, None, None)
        else:
            raise RuntimeError(f"NativeDraftTree: {type(head).__name__} is neither an EAGLE-1 nor an EAGLE-3 head")
        D = head.cfg.hidden_size
        if tuple(emb.shape) != (lm.shape[0], D) or lm.shape[1] != D or emb.dtype not in WDTYPES or emb.device.type != "cpu":
            raise ValueError(f"NativeDraftTree: emb {tuple(emb.shape)} {emb.dtype} on {emb.device} and lm {lm.shape}; "
                             f"need both [Vd, {D}], emb on the CPU in one of {list(WDTYPES)}")
        self.emb = emb.contiguous()
        self._emb_desc = SdWeight(self.emb.data_ptr(), None, *self.emb.shape, WDTYPES[self.emb.dtype], 0)  # plain rows
        self.head, self.layer, self.kind, self.fc, self.lm, self.norms = head, layer, kind, fc, lm, norms
        self.desc = SdDraftHead(kind, None if fc is None else ctypes.pointer(fc.desc), *(fptr(n) for n in norms),
                                ctypes.pointer(lm.desc), ctypes.pointer(self._emb_desc), None, None, 0)
        self._table = None  # the RoPE table the descriptor points into (see _rope)

    def __deepcopy__(self, memo) -> None:
        """The descriptors hold raw pointers into this head's packed layer: a copy drafts with the python path (as a
        copied ``NativeHeadLayer`` does)."""
        return None

    @property
    def nbytes(self) -> int:
        """Weight bytes one depth reads: the layer, the fc (EAGLE-1) and the draft LM head."""
        ws = [self.layer.wqkv, self.layer.wo, self.layer.w13, self.layer.w2, self.lm] + ([self.fc] if self.fc else [])
        return sum(w.nbytes for w in ws)

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's RoPE table [>= n, hd] fp32 (cos, signed sin), grown by the head when n passes it; the call's
        descriptor points at it."""
        table = self.head._rope_table
        if table is None or table[0].shape[0] < n:
            self.head._rope_rows(torch.tensor([n - 1]))
            table = self.head._rope_table
        if self.desc.npos != table[0].shape[0] or self._table is not table:
            self._table = table  # held: the descriptor points into it
            self.desc.cos, self.desc.sin, self.desc.npos = fptr(table[0]), fptr(table[1]), table[0].shape[0]
        return table

    def weights(self) -> DraftWeights:
        """The same weights as plain fp32 tensors, for :func:`draft_tree_ref`."""
        c, L = self.head.cfg, self.layer
        cos, sin = self._rope(1)
        w_in, w_hid, w_out = self.norms
        return DraftWeights(self.kind, L.wqkv.w.float(), L.wo.w.float(), L.ffn_norm, L.w13.w.float(), L.w2.w.float(),
                            self.lm.w.float(), self.emb.float(), cos, sin, c.num_attention_heads,
                            c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                            None if self.fc is None else self.fc.w.float(), None if self.fc is None else self.fc.bias,
                            w_in, w_hid, w_out)

    def __call__(self, last: torch.Tensor, root_logits: torch.Tensor,  # [B, D], [B, Vd]
                 slots: list[int], pos0: list[int], shape: TreeShape, d2t: torch.Tensor | None = None) -> DraftTree:
        if self.head.native is not self.layer:
            raise RuntimeError("NativeDraftTree: the head's layer was packed again since this call was built (its "
                               "descriptors point at the old copy); build a new NativeDraftTree(head, ...)")
        B, D = last.shape
        Vd = self.lm.shape[0]
        if tuple(root_logits.shape) != (B, Vd) or not B:
            raise ValueError(f"NativeDraftTree: last {tuple(last.shape)}, root_logits {tuple(root_logits.shape)}; "
                             f"expected [B, {D}] and [B, {Vd}], B >= 1")
        if shape.depth < 1 or shape.topk < 1 or shape.budget < 1:
            raise ValueError(f"NativeDraftTree: tree shape {shape}; depth, topk and budget must be >= 1")
        cache = self.layer.cache
        k = min(shape.topk, Vd)
        rows = np.array([slots, [cache.seq_len(s) for s in slots], pos0], dtype=np.int64)  # [3, B] slot, start, pos0
        fed = (shape.depth - 1) * k
        if int(rows[1].max()) + fed > cache.max_model_len:
            raise ValueError(f"NativeDraftTree: a slot holds {int(rows[1].max())} pairs and the tree feeds {fed} more "
                             f"> max_len {cache.max_model_len}; build the proposer with a larger max_model_len")
        self._rope(int(rows[2].max()) + shape.depth)
        N = min(shape.budget, k + (shape.depth - 1) * k * k)
        ints = torch.empty(3, B, N, dtype=torch.long)  # tokens (draft ids), parents, ranks
        score = torch.empty(B, N)
        last, root_logits = last.float().contiguous(), root_logits.float().contiguous()
        r, i8 = rows.ctypes.data, 8 * B
        n = ops.lib().sd_eagle_tree(
            ctypes.byref(self.layer.model), ctypes.byref(self.layer.layer), ctypes.byref(self.desc), B, r, r + i8,
            r + 2 * i8, last.data_ptr(), root_logits.data_ptr(), shape.depth, shape.topk, shape.budget,
            self.layer.kt_valid.ctypes.data, ctypes.byref(self.layer.scratch(B * k)), ints[0].data_ptr(),
            ints[1].data_ptr(), score.data_ptr(), ints[2].data_ptr(),
        )  # fmt: skip
        if n < 0:
            raise RuntimeError("NativeDraftTree: a kept node's parent was pruned (NaN draft log-probs?)")
        tok = ints[0] if d2t is None else d2t[ints[0]]
        return DraftTree(tok, ints[1], score, ints[2], torch.full((B,), N, dtype=torch.long))
