"""Triton temperature, top-k / top-p and min-p over [N, V] logits; references and conventions (order,
cut-offs on the logit value so ties with the last kept token are kept) in ``specdec_kernels/sampling_filters.py``.

Top-k and top-p without a sort: each is a per-row threshold search by bisection over the 2^32 ordered
fp32 bit patterns (``_sort_key``: an int32 whose order is the float order), 32 halvings, each one pass
over the row, all rows of a tile searched at once:
- top-k: the largest key t with #{x >= t} >= k, i.e. the k-th largest logit exactly;
- top-p: the largest key t with mass{x >= t} >= top_p (mass under the top-k distribution), i.e. the
  reference's "fewest most likely tokens whose mass reaches top_p", ties on the cut-off value kept.
Exactness: top-k keeps exactly the reference's set. Top-p keeps the same set except when the nucleus mass
at the boundary is within fp32 rounding of top_p (the mass is summed per chunk here, by a cumulative sum
over the sorted row there); -0.0 and +0.0 compare equal (both keyed as +0.0). Cost: ~2 + 32 (top-k) + 33
(top-p) passes over V per row, reads only (the row stays in L2 for V <= ~128k at small N); simple rather
than optimal — a radix select (4 bits per pass) would cut the passes 4x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import FLOATS, INTS, check_device, check_dtype, check_shape, row_tile

_KEY_MIN = -(2 ** 31)  # below the key of every non-NaN float (-inf's key is -2^31 + 2^23 - 1)
_KEY_END = 2 ** 31  # above every key
_RADIX = 16  # thresholds tried per pass: 2^32 keys / 16^8 -> the exact key after 8 passes
_PASSES = 8


@triton.jit
def _sort_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 folded onto +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit(do_not_specialize=["N"])
def _temperature_kernel(x_ptr, s_xn, s_xv, t_ptr, out_ptr, N, V,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < N
    m2 = rmask[:, None] & (cols[None, :] < V)
    t = tl.load(t_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
    t = tl.where(t > 0, t, 1.0)  # 0 = greedy: left unscaled
    x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * V + cols[None, :], tl.div_rn(x, t[:, None]), mask=m2)


@triton.jit
def _radix_step(x_ptr, s_xn, s_xv, rows, rmask, V, lo, hi, floor, row_max, bound,
                MASS: tl.constexpr, RADIX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass of the threshold search: split [lo, hi) into RADIX steps and return the new (lo, hi)
    around the largest threshold t whose count #{key >= t} (MASS: exp-mass of key >= max(t, floor))
    is still >= bound. Invariant kept: lo qualifies, hi does not."""
    step = (hi - lo + RADIX - 1) // RADIX  # [BLOCK_N] int64
    thr = lo[:, None] + tl.arange(0, RADIX)[None, :].to(tl.int64) * step[:, None]  # [BLOCK_N, RADIX]
    if MASS:
        thr_m = tl.maximum(thr, floor[:, None])
    acc = tl.zeros([BLOCK_N, RADIX], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < V)
        x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2,
                    other=-float("inf")).to(tl.float32)
        key = _sort_key(x).to(tl.int64)
        if MASS:
            above = m2[:, :, None] & (key[:, :, None] >= thr_m[:, None, :])  # [BLOCK_N, BLOCK_V, RADIX]
            w = tl.exp(x - row_max[:, None])
            acc += tl.sum(tl.where(above, w[:, :, None], 0.0), axis=1)
        else:
            above = m2[:, :, None] & (key[:, :, None] >= thr[:, None, :])
            acc += tl.sum(above.to(tl.float32), axis=1)  # exact: counts < 2^24
    # acc is non-increasing along the thresholds, and thr[:, 0] = lo qualifies: keep the last that does
    j = tl.sum((acc >= bound[:, None]).to(tl.int64), axis=1) - 1
    new_lo = lo + j * step
    return new_lo, tl.minimum(new_lo + step, hi)


@triton.jit(do_not_specialize=["N"])
def _top_k_top_p_kernel(x_ptr, s_xn, s_xv,  # [N, V] logits
                        k_ptr, p_ptr,  # [N] top_k int / top_p float (unused without HAS_K / HAS_P)
                        out_ptr,  # [N, V] contiguous
                        N, V,
                        HAS_K: tl.constexpr, HAS_P: tl.constexpr, KEY_MIN: tl.constexpr, KEY_END: tl.constexpr,
                        RADIX: tl.constexpr, PASSES: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    keep_all = tl.full([BLOCK_N], KEY_MIN, tl.int64)
    cut = keep_all  # [BLOCK_N]: keep keys >= cut
    row_max = tl.full([BLOCK_N], -float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < V)
        x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2, other=-float("inf"))
        row_max = tl.maximum(row_max, tl.max(x.to(tl.float32), axis=1))
    row_max = tl.where(rmask, row_max, 0.0)  # rows past N: no -inf - -inf below
    if HAS_K:
        top_k = tl.load(k_ptr + rows, mask=rmask, other=0)
        lo = keep_all  # #{key >= lo} = V >= top_k > #{key >= hi} = 0
        hi = tl.full([BLOCK_N], KEY_END, tl.int64)
        for _ in range(PASSES):
            lo, hi = _radix_step(x_ptr, s_xn, s_xv, rows, rmask, V, lo, hi, lo, row_max, top_k.to(tl.float32),
                                 False, RADIX, BLOCK_N, BLOCK_V)
        cut = tl.where((top_k > 0) & (top_k < V), lo, cut)  # <= 0 or >= V: off
    if HAS_P:
        top_p = tl.load(p_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
        total = tl.zeros([BLOCK_N], tl.float32)  # mass of the top-k set
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            m2 = rmask[:, None] & (cols[None, :] < V)
            x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2,
                        other=-float("inf")).to(tl.float32)
            kept = m2 & (_sort_key(x).to(tl.int64) >= cut[:, None])
            total += tl.sum(tl.where(kept, tl.exp(x - row_max[:, None]), 0.0), axis=1)
        lo = keep_all  # mass{key >= lo} = total >= top_p * total > mass{key >= hi} = 0
        hi = tl.full([BLOCK_N], KEY_END, tl.int64)
        for _ in range(PASSES):
            lo, hi = _radix_step(x_ptr, s_xn, s_xv, rows, rmask, V, lo, hi, cut, row_max, top_p * total,
                                 True, RADIX, BLOCK_N, BLOCK_V)
        cut = tl.where(top_p < 1.0, tl.maximum(cut, lo), cut)  # 1 = off, whatever the rounding
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < V)
        x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2, other=0.0)
        kept = _sort_key(x.to(tl.float32)).to(tl.int64) >= cut[:, None]
        tl.store(out_ptr + rows[:, None] * V + cols[None, :], tl.where(kept, x, -float("inf")), mask=m2)


@triton.jit(do_not_specialize=["N"])
def _min_p_kernel(x_ptr, s_xn, s_xv, minp_ptr, out_ptr, N, V,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row_max = tl.full([BLOCK_N], -float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < V)
        x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2, other=-float("inf"))
        row_max = tl.maximum(row_max, tl.max(x.to(tl.float32), axis=1))
    # p_i / p_max = exp(l_i - l_max): compare in logit space, no softmax
    min_p = tl.load(minp_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    cutoff = tl.where(min_p > 0, row_max + tl.log(tl.maximum(min_p, 1e-38)), -float("inf"))  # 0 = off
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols[None, :] < V)
        x = tl.load(x_ptr + rows[:, None] * s_xn + cols[None, :] * s_xv, mask=m2, other=0.0)
        keep = x.to(tl.float32) >= cutoff[:, None]
        tl.store(out_ptr + rows[:, None] * V + cols[None, :], tl.where(keep, x, -float("inf")), mask=m2)


def _check_rows(op: str, logits: torch.Tensor, **per_row: torch.Tensor | None) -> tuple[int, int]:
    check_dtype(op, "logits", logits, FLOATS)
    check_shape(op, "logits", logits, (None, None))
    N, V = logits.shape
    for name, t in per_row.items():
        if t is not None:
            check_shape(op, name, t, (N,))
    check_device(op, logits, *per_row.values())
    return N, V


def apply_temperature(logits: torch.Tensor,  # [N, V] float
                      temperature: torch.Tensor,  # [N] float, 0 = greedy (left unscaled)
                      ) -> torch.Tensor:  # [N, V]
    op = "apply_temperature[triton]"
    N, V = _check_rows(op, logits, temperature=temperature)
    check_dtype(op, "temperature", temperature, FLOATS)
    out = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    if N * V:
        BLOCK_N, BLOCK_V = row_tile(V, N)
        _temperature_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(V, BLOCK_V))](
            logits, *logits.stride(), temperature, out, N, V, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V)
    return out


def apply_top_k_top_p(logits: torch.Tensor,  # [N, V] float
                      top_k: torch.Tensor | None,  # [N] int64; <= 0 or >= V = off; None = off for all
                      top_p: torch.Tensor | None,  # [N] float in (0, 1]; 1 = off; None = off for all
                      ) -> torch.Tensor:  # [N, V], tokens outside the top-k / nucleus set to -inf
    op = "apply_top_k_top_p[triton]"
    if top_k is None and top_p is None:
        return logits
    N, V = _check_rows(op, logits, top_k=top_k, top_p=top_p)
    if top_k is not None:
        check_dtype(op, "top_k", top_k, INTS)
    if top_p is not None:
        check_dtype(op, "top_p", top_p, FLOATS)
    out = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    if N * V:
        BLOCK_N, BLOCK_V = row_tile(V, N, per_elem=_RADIX)
        _top_k_top_p_kernel[(triton.cdiv(N, BLOCK_N),)](
            logits, *logits.stride(), logits if top_k is None else top_k, logits if top_p is None else top_p,
            out, N, V, HAS_K=top_k is not None, HAS_P=top_p is not None, KEY_MIN=_KEY_MIN, KEY_END=_KEY_END,
            RADIX=_RADIX, PASSES=_PASSES, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V)
    return out


def apply_min_p(logits: torch.Tensor,  # [N, V] float
                min_p: torch.Tensor,  # [N] float in [0, 1]; 0 = off
                ) -> torch.Tensor:  # [N, V], tokens with p < min_p * max(p) set to -inf
    op = "apply_min_p[triton]"
    N, V = _check_rows(op, logits, min_p=min_p)
    check_dtype(op, "min_p", min_p, FLOATS)
    out = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    if N * V:
        BLOCK_N, BLOCK_V = row_tile(V, N)
        _min_p_kernel[(triton.cdiv(N, BLOCK_N),)](logits, *logits.stride(), min_p, out, N, V,
                                                  BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V)
    return out
