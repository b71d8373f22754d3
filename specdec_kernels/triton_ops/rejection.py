"""Triton rejection verification: the accept test and the recovered/bonus sample; references and the
conventions (one-hot drafts for ``draft_probs=None``, -1 padding, one noise row per request) are in
``specdec_kernels/rejection.py``.

- ``rejection_accept``: one element per (row, position): two gathered probabilities and one uniform, so
  it reads B*k*3 values, never a vocabulary row.
- ``sample_recovered``: the exponential race ``argmax(max(p - q, 0) / E)`` over the one position each row
  needs, streamed in [BLOCK_B, BLOCK_V] tiles: the residual is formed in registers and never written
  (no second [B, k, V] tensor). A row is split into ``ceil(V / SPLIT_V)`` programs that each keep a
  running (max, first argmax) of the residual race, of the plain-p race (the fallback when the residual
  is empty) and the residual's mass; a second kernel combines the splits in order, so ties go to the lowest
  token id exactly like ``torch.argmax``. Division is ``div_rn`` (IEEE) so the race matches torch bit for
  bit on a GPU too; inputs are read in their dtype and compared in fp32 (exact for fp32 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import (FLOATS, INTS, SPLIT_V, check_device, check_dtype, check_shape, pow2,
                                        row_tile, tile_elems)



@triton.jit(do_not_specialize=["n_pairs", "k"])
def _rejection_accept_kernel(p_ptr, s_pb, s_pk, s_pv,  # target [B, K, V]
                             q_ptr, s_qb, s_qk, s_qv,  # draft [B, k, V] (unused without HAS_Q)
                             ids_ptr, s_ib, s_ik,  # [B, k]
                             u_ptr, s_ub, s_uk,  # [B, k] uniform
                             out_ptr,  # [B, k] bool, contiguous
                             n_pairs, k,
                             HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat b * k + i
    m = offs < n_pairs
    b = offs // k
    i = offs % k
    tok = tl.load(ids_ptr + b * s_ib + i * s_ik, mask=m, other=-1).to(tl.int64)
    valid = m & (tok >= 0)
    tok = tl.maximum(tok, 0)
    p_x = tl.load(p_ptr + b * s_pb + i * s_pk + tok * s_pv, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + b * s_ub + i * s_uk, mask=m, other=1.0).to(tl.float32)
    if HAS_Q:
        q_x = tl.load(q_ptr + b * s_qb + i * s_qk + tok * s_qv, mask=valid, other=0.0).to(tl.float32)
        accepted = u * q_x < p_x  # u < min(1, p/q) without a division; q(x) = 0 accepts iff p(x) > 0
    else:
        accepted = u < p_x  # one-hot q: accept with probability p(x)
    tl.store(out_ptr + offs, accepted & valid, mask=m)


def rejection_accept(target_probs: torch.Tensor,  # [B, K, V] float, K >= k (bonus row ignored)
                     draft_probs: torch.Tensor | None,  # [B, k, V] float, or None = one-hot drafts
                     draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                     uniform: torch.Tensor,  # [B, k] float32 in [0, 1)
                     ) -> torch.Tensor:  # [B, k] bool, position-wise (only the prefix counts)
    op = "rejection_accept[triton]"
    B, k, V = _check_common(op, target_probs, draft_probs, draft_token_ids, min_K=None)
    check_dtype(op, "uniform", uniform, FLOATS)
    check_shape(op, "uniform", uniform, (B, k))
    check_device(op, target_probs, draft_probs, draft_token_ids, uniform)
    out = torch.empty(B, k, dtype=torch.bool, device=target_probs.device)
    if B * k == 0:
        return out
    q = target_probs if draft_probs is None else draft_probs  # a valid pointer either way
    BLOCK = min(tile_elems(), pow2(B * k))  # (row, position) pairs per program
    _rejection_accept_kernel[(triton.cdiv(B * k, BLOCK),)](
        target_probs, *target_probs.stride(), q, *q.stride(), draft_token_ids, *draft_token_ids.stride(),
        uniform, *uniform.stride(), out, B * k, k, HAS_Q=draft_probs is not None, BLOCK=BLOCK)
    return out


@triton.jit(do_not_specialize=["B", "k", "S"])
def _recovered_partial_kernel(p_ptr, s_pb, s_pk, s_pv,  # target [B, K, V]
                              q_ptr, s_qb, s_qk, s_qv,  # draft [B, k, V] (unused without HAS_Q)
                              ids_ptr, s_ib, s_ik,  # [B, k]
                              pos_ptr, s_pos,  # [B] position to sample at
                              e_ptr, s_eb, s_ev,  # [B, V] Exp(1) noise
                              val_ptr, idx_ptr,  # partials [3, B, S] float32 / [2, B, S] int32
                              B, k, V, S,
                              HAS_Q: tl.constexpr, SPLIT: tl.constexpr,
                              BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    pos = tl.load(pos_ptr + rows64 * s_pos, mask=rmask, other=0).to(tl.int64)
    # the draft at `pos`; the bonus position (pos == k), padding and k == 0 have q = 0
    q_pos = tl.maximum(tl.minimum(pos, k - 1), 0)
    tok = tl.load(ids_ptr + rows64 * s_ib + q_pos * s_ik, mask=rmask & (q_pos < k), other=-1).to(tl.int64)
    has_q = (pos < k) & (tok >= 0)
    p_row = p_ptr + rows64 * s_pb + pos * s_pk  # [BLOCK_B] pointers
    q_row = q_ptr + rows64 * s_qb + q_pos * s_qk
    e_row = e_ptr + rows64 * s_eb

    best_w = tl.full([BLOCK_B], -1.0, tl.float32)  # race values are >= 0: -1 = nothing seen yet
    best_wi = tl.zeros([BLOCK_B], tl.int32)
    best_p = tl.full([BLOCK_B], -1.0, tl.float32)
    best_pi = tl.zeros([BLOCK_B], tl.int32)
    mass = tl.zeros([BLOCK_B], tl.float32)
    v_lo = split * SPLIT
    v_hi = tl.minimum(v_lo + SPLIT, V)
    for start in range(v_lo, v_hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < v_hi)
        p = tl.load(p_row[:, None] + cols[None, :] * s_pv, mask=m2, other=0.0).to(tl.float32)
        e = tl.load(e_row[:, None] + cols[None, :] * s_ev, mask=m2, other=1.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_row[:, None] + cols[None, :] * s_qv, mask=m2 & has_q[:, None], other=0.0)
            w = tl.maximum(p - q.to(tl.float32), 0.0)
        else:  # max(p - onehot(x), 0) is p with x removed
            w = tl.where(has_q[:, None] & (cols[None, :] == tok[:, None]), 0.0, p)
        mass += tl.sum(w, axis=1)
        race_w = tl.where(m2, tl.div_rn(w, e), -1.0)
        race_p = tl.where(m2, tl.div_rn(p, e), -1.0)
        # strict > keeps the earlier chunk on ties: the first argmax, as torch.argmax
        cw = tl.max(race_w, axis=1)
        iw = tl.argmax(race_w, axis=1, tie_break_left=True)
        up = cw > best_w
        best_w = tl.where(up, cw, best_w)
        best_wi = tl.where(up, start + iw, best_wi)
        cp = tl.max(race_p, axis=1)
        ip = tl.argmax(race_p, axis=1, tie_break_left=True)
        up = cp > best_p
        best_p = tl.where(up, cp, best_p)
        best_pi = tl.where(up, start + ip, best_pi)
    plane = B * S
    at = rows64 * S + split
    tl.store(val_ptr + at, best_w, mask=rmask)
    tl.store(val_ptr + plane + at, best_p, mask=rmask)
    tl.store(val_ptr + 2 * plane + at, mass, mask=rmask)
    tl.store(idx_ptr + at, best_wi, mask=rmask)
    tl.store(idx_ptr + plane + at, best_pi, mask=rmask)


@triton.jit(do_not_specialize=["B", "S"])
def _recovered_combine_kernel(val_ptr, idx_ptr,  # partials [3, B, S] / [2, B, S]
                              out_ptr,  # [B] int64
                              B, S,
                              BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    splits = tl.arange(0, BLOCK_S)
    rmask = rows < B
    m2 = rmask[:, None] & (splits[None, :] < S)
    at = rows.to(tl.int64)[:, None] * S + splits[None, :]
    plane = B * S
    w = tl.load(val_ptr + at, mask=m2, other=-2.0)
    p = tl.load(val_ptr + plane + at, mask=m2, other=-2.0)
    mass = tl.sum(tl.load(val_ptr + 2 * plane + at, mask=m2, other=0.0), axis=1)
    wi = tl.load(idx_ptr + at, mask=m2, other=0)
    pi = tl.load(idx_ptr + plane + at, mask=m2, other=0)
    sw = tl.argmax(w, axis=1, tie_break_left=True)  # ties: lowest split = lowest token id
    sp = tl.argmax(p, axis=1, tie_break_left=True)
    tok_w = tl.sum(tl.where(splits[None, :] == sw[:, None], wi, 0), axis=1)
    tok_p = tl.sum(tl.where(splits[None, :] == sp[:, None], pi, 0), axis=1)
    # an empty residual (p == q up to rounding: a rejection of probability 0) falls back to p
    tl.store(out_ptr + rows, tl.where(mass > 0, tok_w, tok_p).to(tl.int64), mask=rmask)


def sample_recovered(target_probs: torch.Tensor,  # [B, K, V] float, K = k or k+1
                     draft_probs: torch.Tensor | None,  # [B, k, V] float, or None = one-hot drafts
                     draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                     position: torch.Tensor,  # [B] int64 in [0, K): where to sample (first rejection)
                     exp_noise: torch.Tensor,  # [B, V] float32 Exp(1) noise, > 0
                     ) -> torch.Tensor:  # [B] int64 ~ norm(max(p - q, 0)) at `position` (p at k)
    op = "sample_recovered[triton]"
    B, k, V = _check_common(op, target_probs, draft_probs, draft_token_ids, min_K=1)
    check_dtype(op, "position", position, INTS)
    check_shape(op, "position", position, (B,))
    check_dtype(op, "exp_noise", exp_noise, FLOATS)
    check_shape(op, "exp_noise", exp_noise, (B, V))
    dev = check_device(op, target_probs, draft_probs, draft_token_ids, position, exp_noise)
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out
    S = triton.cdiv(V, SPLIT_V)
    BLOCK_B, BLOCK_V = row_tile(min(V, SPLIT_V), B)
    vals = torch.empty(3, B, S, dtype=torch.float32, device=dev)
    idx = torch.empty(2, B, S, dtype=torch.int32, device=dev)
    q = target_probs if draft_probs is None else draft_probs
    _recovered_partial_kernel[(triton.cdiv(B, BLOCK_B), S)](
        target_probs, *target_probs.stride(), q, *q.stride(), draft_token_ids, *draft_token_ids.stride(),
        position, position.stride(0), exp_noise, *exp_noise.stride(), vals, idx, B, k, V, S,
        HAS_Q=draft_probs is not None, SPLIT=SPLIT_V, BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V)
    BLOCK_B, BLOCK_S = row_tile(S, B)
    _recovered_combine_kernel[(triton.cdiv(B, BLOCK_B),)](vals, idx, out, B, S, BLOCK_B=BLOCK_B, BLOCK_S=BLOCK_S)
    return out


def _check_common(op: str, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                  draft_token_ids: torch.Tensor, min_K: int | None) -> tuple[int, int, int]:
    """(B, k, V) after checking target [B, K >= k, V], draft_probs [B, k, V] and draft ids [B, k]."""
    check_dtype(op, "target_probs", target_probs, FLOATS)
    check_dtype(op, "draft_token_ids", draft_token_ids, INTS)
    check_shape(op, "target_probs", target_probs, (None, None, None))
    B, K, V = target_probs.shape
    check_shape(op, "draft_token_ids", draft_token_ids, (B, None))
    k = draft_token_ids.shape[1]
    if K < max(k, min_K or 0):
        raise ValueError(f"{op}: target_probs has {K} positions for k={k} drafts; expected at least "
                         f"{max(k, min_K or 0)} (k, or k+1 with the bonus position).")
    if draft_probs is not None:
        check_dtype(op, "draft_probs", draft_probs, FLOATS)
        check_shape(op, "draft_probs", draft_probs, (B, k, V))
    return B, k, V
