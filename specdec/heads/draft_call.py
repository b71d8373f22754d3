"""The EAGLE draft of one step in one call: the contract, its torch reference, and the native call.

EAGLE-2's dynamic tree (proposers/dynamic_tree.py) over an EAGLE-1 or EAGLE-3 head, with the catch-up before it: the
committed pairs since the last step go through the head first, and the head's output and draft logits at each
sequence's pending pair (its last catch-up row) root the tree. For B sequences, R = sum(qlens) catch-up rows,
k = min(topk, Vd) children per node, C = k + (depth - 1) k^2 candidates and N = min(budget, C) kept nodes:

inputs
    emb          [R, D] fp32     catch-up rows, sequence after sequence: the target's embedding of each row's token
    feat         [R, F] fp32     their features: the target's (EAGLE-3: its fused layers, F = cfg.feature_size;
                                 EAGLE-1: F = D)
    pos          [R] int64       each row's RoPE position (the pair of token i sits at i - 1)
    qlens        [B] int >= 1    rows per sequence; its last row is the pending pair, at position pos0
    slots        [B]             each sequence's head KV slot; its length before the call (``starts``) = the pairs
                                 kept from earlier steps
    shape        TreeShape       depth, topk, budget
    d2t          [Vd] int64      target id of each draft id (None: the draft vocabulary is the target's)
outputs (:class:`DraftTree`)
    tokens       [B, N] int64    target ids, nodes in creation order (depth-major, a parent before its children)
    parents      [B, N] int64    index of the parent among the kept nodes, -1 = child of the pending token
    logprobs     [B, N] fp32     cumulative draft log-prob of the path to the node
    rank         [B, N] int64    0 = best logprob; ties: the earlier-made first (``graft_within_budget`` reads it)
    num_nodes    [B] int64       N in every row
    last         [B, D] fp32     the head's output at each pending pair (what the chain path drafts from)
    root_logits  [B, Vd] fp32    its draft logits: the token after the pending token

What it does. The catch-up: each sequence's rows are appended to its slot at cache index starts[b] + i, causal among
themselves after the cached prefix, as ``head.forward_logits`` feeds them (the same products in the same order, so
the same keys and values); the slot then holds starts[b] + qlens[b] pairs. Then each depth: depth 1 = the top k of
log_softmax(root_logits). For d = 2..depth the k frontier nodes of depth d-1 are appended as new pairs (embedding of
the node's token, the head's output at its parent) at cache index starts + qlens + (d - 2) k + i, position pos0 + d - 1,
each attending to the cached prefix and to its ancestors among the appended nodes; their k x k children are scored
parent + log-prob, and the k best (ties: the earlier-made) form the next frontier. Then the N best candidates of all
depths by a stable descending sort, kept in creation order (so every kept node's ancestors are kept: a child's score
is its parent's plus a log-prob <= 0). This is what the catch-up + ``build_ranked_tree`` + ``head_expand`` compute,
except that each node is fed once instead of re-feeding every frontier so far at each depth: (depth - 1) k rows in all
instead of k (1 + 2 + ... + (depth - 1)).

The head's KV cache: the call leaves each slot at starts + qlens pairs (the committed ones, as EagleProposer's
rollback after a tree would) and the keys and values of the (depth - 1) k fed nodes past them as scratch that the next
catch-up overwrites.

:func:`draft_tree_ref` is the readable torch reference over plain weights (:class:`DraftWeights`);
:class:`NativeDraftTree` runs the same contract in one call of the CPU kernels (``sd_eagle_tree``,
``specdec/engine/cpu/csrc/draft_tree.h``); ``tests/heads/test_draft_call.py`` compares them. Knows nothing about
proposers, requests, the pairs' bookkeeping, n-gram branches or the target engine.
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
    last: torch.Tensor  # [B, D] float32 the head's output at each pending pair (the catch-up's last row)
    root_logits: torch.Tensor  # [B, Vd] float32 its draft logits


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
    fc: torch.Tensor | None = None  # EAGLE-1 [D, 2D] over cat(emb, feat); EAGLE-3 [D, F] over the target's features
    fc_bias: torch.Tensor | None = None  # [D]
    w_in: torch.Tensor | None = None  # EAGLE-3 [D] norm of the embedding
    w_hid: torch.Tensor | None = None  # EAGLE-3 [D] norm of the head's own output
    w_out: torch.Tensor | None = None  # EAGLE-3 [D] norm before the LM head
    # the products whose input the kernels round to bf16 first (bf16 weights on the vdpbf16ps build: kernels.cpp)
    round_x: frozenset[str] = frozenset()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _lin(w: DraftWeights, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.<name>^T (+ bias), x rounded to bf16 first where the kernels' product does that (``round_x``)."""
    return F.linear(x.bfloat16().float() if name in w.round_x else x, getattr(w, name), bias)


def _head_rows(w: DraftWeights, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor,
               vc: torch.Tensor, at: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head on n new pairs of one sequence: emb [n, D], feat [n, F] (the target's features) or [n, D] (the head's
    own outputs), pos [n]; keys written to kc/vc [nkv, L, hd] at [at, at + n); mask [n, at + n] bool the keys each row
    sees -> (outputs [n, D], draft logits [n, Vd])."""
    n, D = emb.shape
    if w.kind == 3:
        x = _lin(w, "fc", feat, w.fc_bias) if feat.shape[-1] != D else feat  # as Eagle3Head.fuse
        a = torch.cat([_rms(emb, w.w_in, w.eps), _rms(x, w.w_hid, w.eps)], -1)  # [n, 2D]
    else:
        x = a = _lin(w, "fc", torch.cat([emb, feat], -1), w.fc_bias)  # [n, D]
    q, k, v = _lin(w, "wqkv", a).split([w.nh * w.hd, w.nkv * w.hd, w.nkv * w.hd], -1)
    q, k, v = q.view(n, w.nh, w.hd), k.view(n, w.nkv, w.hd), v.view(n, w.nkv, w.hd)
    cos, sin = w.cos[pos][:, None], w.sin[pos][:, None]  # [n, 1, hd] each
    q, k = (t * cos + t.roll(w.hd // 2, -1) * sin for t in (q, k))
    kc[:, at:at + n], vc[:, at:at + n] = k.transpose(0, 1), v.transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :at + n], vc[None, :, :at + n],
                                       attn_mask=mask, enable_gqa=w.nh != w.nkv)  # [1, nh, n, hd]
    x = x + _lin(w, "wo", o[0].transpose(0, 1).reshape(n, -1))
    g, u = _lin(w, "w13", _rms(x, w.ffn_norm, w.eps)).chunk(2, -1)
    x = x + _lin(w, "w2", F.silu(g) * u)
    return x, _lin(w, "lm", _rms(x, w.w_out, w.eps) if w.kind == 3 else x)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best of scores [n] (ties: the lower index first), in that order."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


@torch.inference_mode()
def draft_tree_ref(w: DraftWeights, k_cache: torch.Tensor,  # [S, nkv, L, hd] the head's keys (written past starts)
                   v_cache: torch.Tensor,  # [S, nkv, L, hd]
                   emb: torch.Tensor, feat: torch.Tensor, pos: list[int],  # [R, D], [R, F], [R]: the catch-up rows
                   qlens: list[int], slots: list[int], starts: list[int], shape: TreeShape,
                   d2t: torch.Tensor | None = None) -> DraftTree:
    """The contract of the module docstring in plain torch, one sequence at a time (``starts``: each slot's length
    before the call; the caller's cache bookkeeping is not touched)."""
    B, Vd = len(slots), w.lm.shape[0]
    k = min(shape.topk, Vd)
    rows, lasts, roots, r0 = [], [], [], 0
    for b in range(B):
        n, kc, vc = qlens[b], k_cache[slots[b]], v_cache[slots[b]]
        causal = torch.ones(n, starts[b] + n, dtype=torch.bool).tril_(starts[b])
        o, logits = _head_rows(w, emb[r0:r0 + n].float(), feat[r0:r0 + n].float(), torch.tensor(pos[r0:r0 + n]), kc,
                               vc, starts[b], causal)  # the catch-up
        start, pos0, r0 = starts[b] + n, pos[r0 + n - 1], r0 + n
        lasts.append(o[-1])
        roots.append(logits[-1].float())
        lp = torch.log_softmax(roots[-1], -1)
        top = _top(lp, k)
        tok, par, sc = top.tolist(), [-1] * k, [lp[top]]  # per candidate id: draft id, parent; scores by depth
        front, out = list(range(k)), {-1: lasts[-1]}  # frontier candidate ids; head output per fed candidate
        fed: list[int] = []  # candidate ids in feeding order (= their cache index past start)
        for d in range(2, shape.depth + 1):
            fed += front
            F_ = len(fed)
            anc = torch.zeros(F_, F_, dtype=torch.bool)  # [F, F] ancestor-or-self among the fed nodes
            for i, c in enumerate(fed):
                if par[c] >= 0:
                    anc[i] = anc[fed.index(par[c])]
                anc[i, i] = True
            mask = torch.cat([torch.ones(k, start, dtype=torch.bool), anc[F_ - k:]], 1)  # [k, start + F]
            feat_ = torch.stack([out[par[c]] for c in front])  # [k, D]
            o, logits = _head_rows(w, w.emb[torch.tensor([tok[c] for c in front])], feat_,
                                   torch.full((k,), pos0 + d - 1), kc, vc, start + F_ - k, mask)
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
                     torch.full((B,), len(rows[0][0]), dtype=torch.long), torch.stack(lasts), torch.stack(roots))


class NativeDraftTree:
    """The contract in one call of the CPU kernels, over a head whose decoder layer is packed
    (``head.native``, a ``NativeHeadLayer``). ``emb``: the target's embedding of each draft id [Vd, D] (fp32, bf16 or
    fp16; read as it is, k rows per depth, so it is not packed and may be a tensor the caller already holds: the tree
    nodes' embeddings; the catch-up rows' come with each call, their tokens being any target ids);
    ``lm``: the draft LM head rows, packed (EAGLE-3: None = the head's own)."""

    def __init__(self, head, emb: torch.Tensor, lm: NativeWeight | None = None) -> None:
        layer = head.native
        if layer is None or ops.lib() is None:
            raise RuntimeError("NativeDraftTree: the head's layer is not packed for the CPU kernels; call "
                               "head.use_native() first (or draft with the torch path)")
        if head.feat_scale is not None:
            raise RuntimeError("NativeDraftTree: the head has a training-time feature scale; export it first")
        if layer.fused is not None:  # EAGLE-3: its fc reads only the catch-up rows' target features
            kind, fc, lm = 3, layer.fused.fc, layer.fused.lm
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
        self.desc = SdDraftHead(kind, ctypes.pointer(fc.desc), *(fptr(n) for n in norms), ctypes.pointer(lm.desc),
                                ctypes.pointer(self._emb_desc), None, None, 0)
        self._table = None  # the RoPE table the descriptor points into (see _rope)
        self._args = (ctypes.byref(layer.model), ctypes.byref(layer.layer), ctypes.byref(self.desc))  # fixed per head
        self._kt_valid = layer.kt_valid.ctypes.data  # the layer's array, never replaced

    def __deepcopy__(self, memo) -> None:
        """The descriptors hold raw pointers into this head's packed layer: a copy drafts with the python path (as a
        copied ``NativeHeadLayer`` does)."""
        return None

    @property
    def nbytes(self) -> int:
        """Weight bytes one depth reads: the layer, the fc (EAGLE-1) and the draft LM head."""
        ws = [self.layer.wqkv, self.layer.wo, self.layer.w13, self.layer.w2, self.lm] + ([self.fc] if self.kind == 1 else [])
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
        from specdec.engine.cpu.build import BF16_ISAS, choose_isa

        packed = {"wqkv": L.wqkv, "wo": L.wo, "w13": L.w13, "w2": L.w2, "lm": self.lm, "fc": self.fc}
        dp = choose_isa() in BF16_ISAS  # vdpbf16ps or AMX: a bf16 product rounds its input to bf16
        return DraftWeights(self.kind, L.wqkv.w.float(), L.wo.w.float(), L.ffn_norm, L.w13.w.float(), L.w2.w.float(),
                            self.lm.w.float(), self.emb.float(), cos, sin, c.num_attention_heads,
                            c.num_key_value_heads, c.head_dim, c.rms_norm_eps, self.fc.w.float(), self.fc.bias,
                            w_in, w_hid, w_out,
                            frozenset(n for n, nw in packed.items() if dp and nw.w.dtype == torch.bfloat16))

    def __call__(self, emb: torch.Tensor, feat: torch.Tensor, pos: list[int],  # [R, D], [R, F], [R]
                 qlens: list[int], slots: list[int], shape: TreeShape, d2t: torch.Tensor | None = None) -> DraftTree:
        """The catch-up rows through the head, then the tree (the module docstring's contract); each slot ends at its
        length before the call + its qlen."""
        if self.head.native is not self.layer:
            raise RuntimeError("NativeDraftTree: the head's layer was packed again since this call was built (its "
                               "descriptors point at the old copy); build a new NativeDraftTree(head, ...)")
        B, (R, D), Vd = len(slots), emb.shape, self.lm.shape[0]
        Fw = feat.shape[-1]
        if not B or len(qlens) != B or min(qlens) < 1 or sum(qlens) != R or len(pos) != R or feat.shape[0] != R:
            raise ValueError(f"NativeDraftTree: {B} slots, qlens {qlens}, emb {tuple(emb.shape)}, feat "
                             f"{tuple(feat.shape)}, {len(pos)} positions; need B >= 1 sequences of >= 1 catch-up "
                             "rows each, R = sum(qlens) rows of each input")
        if D != self.head.cfg.hidden_size or Fw not in (D, self.fc.shape[1] if self.kind == 3 else D):
            raise ValueError(f"NativeDraftTree: emb {tuple(emb.shape)}, feat {tuple(feat.shape)}; the head takes "
                             f"[R, {self.head.cfg.hidden_size}] embeddings and [R, {self.head.cfg.feature_size}] features")
        if shape.depth < 1 or shape.topk < 1 or shape.budget < 1:
            raise ValueError(f"NativeDraftTree: tree shape {shape}; depth, topk and budget must be >= 1")
        cache = self.layer.cache
        k = min(shape.topk, Vd)
        starts = [cache.seq_len(s) for s in slots]
        need = max(st + q for st, q in zip(starts, qlens)) + (shape.depth - 1) * k
        if need > cache.max_model_len:
            raise ValueError(f"NativeDraftTree: a slot would hold {need} pairs (its catch-up and the tree's nodes) > "
                             f"max_len {cache.max_model_len}; build the proposer with a larger max_model_len")
        self._rope(max(pos) + shape.depth)
        N = min(shape.budget, k + (shape.depth - 1) * k * k)
        rows = np.array([*slots, *starts, *qlens, *pos], dtype=np.int64)  # [3 B + R] slot, start, qlen; positions
        ints = torch.empty(3, B, N, dtype=torch.long)  # tokens (draft ids), parents, ranks
        score, last, root = torch.empty(B, N), torch.empty(B, D), torch.empty(B, Vd)
        emb, feat = emb.float().contiguous(), feat.float().contiguous()  # held here while the kernel reads them
        r, i8, o, o8 = rows.ctypes.data, 8 * B, ints.data_ptr(), 8 * B * N
        n = ops.lib().sd_eagle_tree(
            *self._args, B, r, r + i8, r + 2 * i8, emb.data_ptr(), feat.data_ptr(), Fw, r + 3 * i8, shape.depth,
            shape.topk, shape.budget, self._kt_valid, ctypes.byref(self.layer.scratch(max(B * k, R))), last.data_ptr(),
            root.data_ptr(), o, o + o8, score.data_ptr(), o + 2 * o8,
        )  # fmt: skip
        for s, st, q in zip(slots, starts, qlens):  # the catch-up's pairs are the slot's now (kt_valid: the kernel)
            cache.lens[s] = st + q
        if n < 0:
            raise RuntimeError("NativeDraftTree: a kept node's parent was pruned (NaN draft log-probs?)")
        tok = ints[0] if d2t is None else d2t[ints[0]]
        return DraftTree(tok, ints[1], score, ints[2], torch.full((B,), N, dtype=torch.long), last, root)
