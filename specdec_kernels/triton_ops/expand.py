"""Triton per-token expansion of per-request values; reference in ``specdec_kernels/expand.py``.

Program (b, d-block) copies row b of ``x`` (viewed as [B, D]) to its ``num_tokens[b]`` output rows,
starting at the exclusive prefix sum of the counts (a tensor of counts needs one host read of their
total to size the output, as ``torch.repeat_interleave`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import INTS, MAX_TILE, check_device, check_dtype, pow2


@triton.jit(do_not_specialize=["num", "D"])
def _expand_kernel(x_ptr,  # [B, D] contiguous
                   counts_ptr, starts_ptr,  # [B] int64 (unused without HAS_COUNTS)
                   out_ptr,  # [sum(counts), D] contiguous
                   num, D,  # tokens per row without HAS_COUNTS; row width
                   HAS_COUNTS: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_COUNTS:
        n = tl.load(counts_ptr + b)
        first = tl.load(starts_ptr + b)
    else:
        n = num
        first = b * num
    vals = tl.load(x_ptr + b * D + cols, mask=cmask)
    for t in range(n):
        tl.store(out_ptr + (first + t) * D + cols, vals, mask=cmask)


def expand_per_token(x: torch.Tensor,  # [B, ...] one value per request
                     num_tokens: int | torch.Tensor,  # int, or [B] int64 tokens per request
                     ) -> torch.Tensor:  # [sum(num_tokens), ...] request-major: b0 b0 .. b1 b1 ..
    op = "expand_per_token[triton]"
    if x.dim() == 0:
        raise ValueError(f"{op}: x is a scalar; expected [B, ...] (one value per request).")
    B = x.shape[0]
    if isinstance(num_tokens, int):
        if num_tokens < 0:
            raise ValueError(f"expand_per_token: num_tokens={num_tokens} must be >= 0.")
        counts = starts = None
        total = B * num_tokens
    else:
        if num_tokens.shape != (B,):
            raise ValueError(f"expand_per_token: num_tokens has shape {tuple(num_tokens.shape)}, "
                             f"expected [{B}] (one count per row of x).")
        check_dtype(op, "num_tokens", num_tokens, INTS)
        check_device(op, x, num_tokens)
        counts = num_tokens.to(torch.int64)
        ends = counts.cumsum(0)
        starts = ends - counts
        total = int(ends[-1]) if B else 0  # the output size: one host read, as repeat_interleave
    out = torch.empty((total, *x.shape[1:]), dtype=x.dtype, device=x.device)
    D = x[0].numel() if B else 0
    if total == 0 or D == 0:
        return out
    src = x.contiguous()
    if x.dtype == torch.bool:  # copy the bytes
        src, dst = src.view(torch.uint8), out.view(torch.uint8)
    else:
        dst = out
    BLOCK_D = min(pow2(D), MAX_TILE)
    _expand_kernel[(B, triton.cdiv(D, BLOCK_D))](
        src, counts if counts is not None else src, starts if starts is not None else src, dst,
        num_tokens if counts is None else 0, D, HAS_COUNTS=counts is not None, BLOCK_D=BLOCK_D)
    return out
