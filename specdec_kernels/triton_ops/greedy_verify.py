"""Triton greedy verification; the reference and its semantics are in ``specdec_kernels/greedy_verify.py``.

One program holds a [BLOCK_B rows, BLOCK_K positions] tile: the accepted length is the first position
where the draft differs from the argmax (positions >= k count as differing), then one masked store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import INTS, check_device, check_dtype, check_shape, pow2, tile_elems


@triton.jit(do_not_specialize=["B", "k"])
def _greedy_verify_kernel(argmax_ptr, s_ab, s_ak,  # [B, k+1]
                          draft_ptr, s_db, s_dk,  # [B, k]
                          out_ptr,  # [B, k+1] int64, contiguous
                          B, k,
                          BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    in_k1 = rmask[:, None] & (cols[None, :] < k + 1)
    in_k = rmask[:, None] & (cols[None, :] < k)
    target = tl.load(argmax_ptr + rows64[:, None] * s_ab + cols[None, :] * s_ak, mask=in_k1, other=-1)
    draft = tl.load(draft_ptr + rows64[:, None] * s_db + cols[None, :] * s_dk, mask=in_k, other=-1)
    differs = (draft.to(tl.int64) != target.to(tl.int64)) | (cols[None, :] >= k)  # padding (-1) differs
    n = tl.min(tl.where(differs, cols[None, :], BLOCK_K), axis=1)  # [BLOCK_B] accepted drafts
    out = tl.where(cols[None, :] <= n[:, None], target.to(tl.int64), -1)
    tl.store(out_ptr + rows64[:, None] * (k + 1) + cols[None, :], out, mask=in_k1)


def greedy_verify(target_argmax: torch.Tensor,  # [B, k+1] int64 target argmax at each position
                  draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                  ) -> torch.Tensor:  # [B, k+1] int64, -1 after the first mismatch
    op = "greedy_verify[triton]"
    check_device(op, target_argmax, draft_token_ids)
    check_dtype(op, "target_argmax", target_argmax, INTS)
    check_dtype(op, "draft_token_ids", draft_token_ids, INTS)
    if target_argmax.dim() != 2:
        raise ValueError(f"{op}: target_argmax has shape {tuple(target_argmax.shape)}, expected [B, k+1].")
    B, k1 = target_argmax.shape
    check_shape(op, "draft_token_ids", draft_token_ids, (B, k1 - 1))
    out = torch.empty(B, k1, dtype=torch.int64, device=target_argmax.device)
    if B == 0:
        return out
    BLOCK_K = pow2(k1)
    BLOCK_B = max(1, min(tile_elems() // BLOCK_K, pow2(B)))
    _greedy_verify_kernel[(triton.cdiv(B, BLOCK_B),)](
        target_argmax, *target_argmax.stride(), draft_token_ids, *draft_token_ids.stride(), out,
        B, k1 - 1, BLOCK_B=BLOCK_B, BLOCK_K=BLOCK_K)
    return out
