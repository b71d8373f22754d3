"""Triton typical acceptance; the rule and its reference are in ``specdec_kernels/typical.py``.

One (row, position) per tile row: the entropy streams over V in [BLOCK_R, BLOCK_V] tiles and p(x) is one
gathered load. The decision ``p(x) > min(threshold, alpha * exp(-H))`` equals the reference's except where
p(x) lies within fp32 rounding of the threshold (the entropy is summed in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import FLOATS, INTS, check_device, check_dtype, check_shape, row_tile

_ENTROPY_EPS = 1e-5  # as specdec_kernels/typical.py (vLLM v0)


@triton.jit(do_not_specialize=["n_rows", "k"])
def _typical_accept_kernel(p_ptr, s_pb, s_pk, s_pv,  # target [B, K, V]
                           ids_ptr, s_ib, s_ik,  # [B, k]
                           out_ptr,  # [B, k] bool, contiguous
                           n_rows, k, V, posterior_threshold, posterior_alpha,
                           EPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat b * k + i
    rmask = r < n_rows
    b = r // k
    i = r % k
    row = p_ptr + b * s_pb + i * s_pk  # [BLOCK_R] pointers
    entropy = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < V)
        p = tl.load(row[:, None] + cols[None, :] * s_pv, mask=m2, other=0.0).to(tl.float32)
        entropy -= tl.sum(p * tl.log(p + EPS), axis=1)
    tok = tl.load(ids_ptr + b * s_ib + i * s_ik, mask=rmask, other=-1).to(tl.int64)
    p_x = tl.load(row + tl.maximum(tok, 0) * s_pv, mask=rmask & (tok >= 0), other=0.0).to(tl.float32)
    threshold = tl.minimum(posterior_alpha * tl.exp(-entropy), posterior_threshold)
    tl.store(out_ptr + r, (p_x > threshold) & (tok >= 0), mask=rmask)


def typical_accept(target_probs: torch.Tensor,  # [B, K, V] float, K >= k (bonus row ignored)
                   draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding (never accepted)
                   posterior_threshold: float,
                   posterior_alpha: float,
                   ) -> torch.Tensor:  # [B, k] bool, position-wise
    op = "typical_accept[triton]"
    check_dtype(op, "target_probs", target_probs, FLOATS)
    check_dtype(op, "draft_token_ids", draft_token_ids, INTS)
    check_shape(op, "target_probs", target_probs, (None, None, None))
    B, K, V = target_probs.shape
    check_shape(op, "draft_token_ids", draft_token_ids, (B, None))
    k = draft_token_ids.shape[1]
    if K < k:
        raise ValueError(f"{op}: target_probs has {K} positions for k={k} drafts; expected at least k.")
    check_device(op, target_probs, draft_token_ids)
    out = torch.empty(B, k, dtype=torch.bool, device=target_probs.device)
    if B * k == 0:
        return out
    BLOCK_R, BLOCK_V = row_tile(V, B * k)
    _typical_accept_kernel[(triton.cdiv(B * k, BLOCK_R),)](
        target_probs, *target_probs.stride(), draft_token_ids, *draft_token_ids.stride(), out, B * k, k, V,
        float(posterior_threshold), float(posterior_alpha), EPS=_ENTROPY_EPS, BLOCK_R=BLOCK_R, BLOCK_V=BLOCK_V)
    return out
