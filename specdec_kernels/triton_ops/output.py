"""Triton output placement and accepted-prefix length; references in ``specdec_kernels/output.py``.

Both work on a [BLOCK_B rows, BLOCK_K positions] tile (BLOCK_K = next power of two of k+1, so a column
>= k always exists to end the accepted prefix).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import INTS, check_device, check_dtype, check_shape, pow2, tile_elems


@triton.jit
def _accepted_prefix(acc_ptr, s_ab, s_ak, rows64, rmask, cols, k, BLOCK_K: tl.constexpr):
    """[BLOCK_B] index of the first False of each row of accepted [B, k] (k if none)."""
    in_k = rmask[:, None] & (cols[None, :] < k)
    acc = tl.load(acc_ptr + rows64[:, None] * s_ab + cols[None, :] * s_ak, mask=in_k, other=0)
    stop = (acc == 0) | (cols[None, :] >= k)
    return tl.min(tl.where(stop, cols[None, :], BLOCK_K), axis=1)


@triton.jit(do_not_specialize=["B", "k"])
def _num_accepted_kernel(acc_ptr, s_ab, s_ak,  # [B, k] bool
                         out_ptr,  # [B] int64
                         B, k,
                         BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    n = _accepted_prefix(acc_ptr, s_ab, s_ak, rows.to(tl.int64), rmask, tl.arange(0, BLOCK_K), k, BLOCK_K)
    tl.store(out_ptr + rows, n.to(tl.int64), mask=rmask)


@triton.jit(do_not_specialize=["B", "k"])
def _create_output_kernel(acc_ptr, s_ab, s_ak,  # [B, k] bool
                          draft_ptr, s_db, s_dk,  # [B, k]
                          rec_ptr, s_r,  # [B]
                          bonus_ptr, s_o,  # [B]
                          out_ptr,  # [B, k+1] int64, contiguous
                          B, k,
                          BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    n = _accepted_prefix(acc_ptr, s_ab, s_ak, rows64, rmask, cols, k, BLOCK_K)  # [BLOCK_B]
    recovered = tl.load(rec_ptr + rows64 * s_r, mask=rmask, other=-1).to(tl.int64)
    bonus = tl.load(bonus_ptr + rows64 * s_o, mask=rmask, other=-1).to(tl.int64)
    final = tl.where(n == k, bonus, recovered)
    drafts = tl.load(draft_ptr + rows64[:, None] * s_db + cols[None, :] * s_dk,
                     mask=rmask[:, None] & (cols[None, :] < k), other=-1).to(tl.int64)
    out = tl.where(cols[None, :] < n[:, None], drafts, tl.where(cols[None, :] == n[:, None], final[:, None], -1))
    tl.store(out_ptr + rows64[:, None] * (k + 1) + cols[None, :], out,
             mask=rmask[:, None] & (cols[None, :] < k + 1))


def _tile(B: int, k: int) -> tuple[int, int]:
    BLOCK_K = pow2(k + 1)
    return max(1, min(tile_elems() // BLOCK_K, pow2(B))), BLOCK_K


def num_accepted(accepted: torch.Tensor,  # [B, k] bool: position-wise acceptance
                 ) -> torch.Tensor:  # [B] int64: index of the first False (k if none)
    op = "num_accepted[triton]"
    check_dtype(op, "accepted", accepted, (torch.bool,))
    check_shape(op, "accepted", accepted, (None, None))
    B, k = accepted.shape
    out = torch.empty(B, dtype=torch.int64, device=accepted.device)
    if B:
        BLOCK_B, BLOCK_K = _tile(B, k)
        _num_accepted_kernel[(triton.cdiv(B, BLOCK_B),)](accepted, *accepted.stride(), out, B, k,
                                                         BLOCK_B=BLOCK_B, BLOCK_K=BLOCK_K)
    return out


def create_output(accepted: torch.Tensor,  # [B, k] bool position-wise (only the prefix counts)
                  draft_token_ids: torch.Tensor,  # [B, k] int64
                  recovered_token_ids: torch.Tensor,  # [B] int64: token at the first rejection
                  bonus_token_ids: torch.Tensor,  # [B] int64: token at position k if all accepted
                  ) -> torch.Tensor:  # [B, k+1] int64, -1 after the emitted tokens
    op = "create_output[triton]"
    check_device(op, accepted, draft_token_ids, recovered_token_ids, bonus_token_ids)
    check_dtype(op, "accepted", accepted, (torch.bool,))
    for name, t in (("draft_token_ids", draft_token_ids), ("recovered_token_ids", recovered_token_ids),
                    ("bonus_token_ids", bonus_token_ids)):
        check_dtype(op, name, t, INTS)
    check_shape(op, "draft_token_ids", draft_token_ids, (None, None))
    B, k = draft_token_ids.shape
    check_shape(op, "accepted", accepted, (B, k))
    check_shape(op, "recovered_token_ids", recovered_token_ids, (B,))
    check_shape(op, "bonus_token_ids", bonus_token_ids, (B,))
    out = torch.empty(B, k + 1, dtype=torch.int64, device=draft_token_ids.device)
    if B:
        BLOCK_B, BLOCK_K = _tile(B, k)
        _create_output_kernel[(triton.cdiv(B, BLOCK_B),)](
            accepted, *accepted.stride(), draft_token_ids, *draft_token_ids.stride(),
            recovered_token_ids, recovered_token_ids.stride(0), bonus_token_ids, bonus_token_ids.stride(0),
            out, B, k, BLOCK_B=BLOCK_B, BLOCK_K=BLOCK_K)
    return out
