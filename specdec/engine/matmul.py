"""Which library multiplies a few rows of activations by a weight matrix, and the thread hand-off it needs.

Decoding is matrix-vector products over ~450 MB of fp32 weights, so their speed is the engine's speed.
Measured on the project's 2-core AMD EPYC (AVX2), fp32, 30 layers of SmolLM2-135M-shaped matrices
(425 MB), cache-cold, ms per pass (`experiments/LOG.md`, 2026-11-22, "numpy's OpenBLAS GEMV"):

| rows M | torch `x @ W[in,out]` (MKL) | torch `W[out,in] @ x.T` (MKL) | numpy `W[out,in] @ x` (OpenBLAS) |
|---|---|---|---|
| 1 | 19.8 (21 GB/s) | 25.3 | **9.9 (43 GB/s)**, = `W.sum()`'s read rate |
| 2 | 28.6 | **11.8** | 23.1 |
| 5 | 34.4 | **18.7** | 29.1 |
| 8 | 39.4 | **26.0** | 25.2 |
| 32 | 62.2 | 49.4 | 45.8 |

Hence, per call (``mm``): one row of fp32 on the CPU, inside ``blas_forward``, goes to NumPy's bundled OpenBLAS
sgemv on the ``[out, in]`` matrix; 2..``SMALL_M`` rows to MKL's ``W[out,in] @ x.T``, made contiguous (a transposed result reaches SDPA
with a last-dim stride != 1 and sends it to its math path: B=8 decode 168 ms instead of 47); more rows to
``x @ W[in,out]``. Other dtypes and devices always take torch.

OpenBLAS and torch's OpenMP pool must not run at once: OpenMP workers spin for milliseconds after each
parallel region and OpenBLAS threads spin between calls; on 2 cores the two pools made a decode step 240 ms
instead of 14, and a step whose sampler ran on 2 torch threads before the next forward 31 ms instead of 17.
So one-row forwards switch the process to *decode mode* (``blas_forward``): torch on 1 thread (its ops there
are small: norms, RoPE, one-token attention, the sampler), OpenBLAS on the threads torch had. The mode is
sticky, so the sampler between two decode forwards stays on 1 thread too; the next multi-row forward
(prefill, verification) or ``release_threads()`` (the step loop calls it when it runs out of requests)
stops OpenBLAS's workers, which would otherwise spin for ~0.1 s, and gives torch its threads back. Speculative
decoding alternates the two modes every step (one-row drafts, multi-row verification): 5-row forwards after
1-row ones took 70-110 ms with the workers left spinning, 31 ms once stopped, as many as without OpenBLAS.
Outside decode mode one row goes through torch's MKL.

``SPECDEC_BLAS=0`` in the environment (or ``use_blas(False)``) keeps every product in torch, to compare.

This module knows nothing about models: it gets ``[M, in]`` activations and a ``Weight``.
"""

from __future__ import annotations

import os
import numpy as np
import torch

__all__ = ["SMALL_M", "Weight", "blas_forward", "in_decode_mode", "mm", "release_threads", "use_blas"]

# Up to this many rows MKL reads the [out, in] copy (table above); from there `x @ W[in,out]` is as fast.
SMALL_M = 32


class Weight:
    """One projection's matrix in the layouts ``mm`` reads, plus its bias. Once the CPU kernels have packed it
    (``keep_packed``), the packed copy is the only one: ``w`` and ``w_t`` unpack it on demand (the torch
    reference path, checkpoints) and the OpenBLAS one-row path is off."""

    __slots__ = ("_w", "_w_t", "bias", "w_np", "_packed")

    def __init__(self, w: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
                 w_np: np.ndarray | None = None) -> None:
        self._w = w  # [in, out] contiguous: read for 1 row off the fast path and for > SMALL_M rows
        self._w_t = w_t  # [out, in] contiguous: read for 2..SMALL_M rows, and by OpenBLAS for 1 row
        self.bias = bias  # [out]
        self.w_np = w_np  # w_t as a NumPy array sharing its memory; None = no OpenBLAS path
        self._packed = None  # the kernels' cpu.ops.NativeWeight of w_t once keep_packed ran

    @classmethod
    def from_in_out(cls, w: torch.Tensor, bias: torch.Tensor | None = None, w_t: torch.Tensor | None = None) -> Weight:
        """From an ``[in, out]`` matrix (``w_t``: an existing ``[out, in]`` copy to share, e.g. a tied embedding)."""
        w_t = w.t().contiguous() if w_t is None else w_t
        w_np = w_t.numpy() if w_t.dtype == torch.float32 and w_t.device.type == "cpu" else None
        return cls(w, w_t, bias, w_np)

    @property
    def w(self) -> torch.Tensor:  # [in, out] (a transposed view of the unpacked [out, in] once packed)
        return self._w if self._w is not None else self._packed.w.t()

    @property
    def w_t(self) -> torch.Tensor:  # [out, in]
        return self._w_t if self._w_t is not None else self._packed.w

    @property
    def dtype(self) -> torch.dtype:
        return self._w_t.dtype if self._w_t is not None else self._packed.dtype

    def keep_packed(self, packed) -> None:
        """Drop the plain copies: ``packed`` (a cpu.ops.NativeWeight of ``w_t``) is the only one from now on."""
        self._packed = packed
        self._w = self._w_t = self.w_np = None


_state = {
    "enabled": os.environ.get("SPECDEC_BLAS", "1") != "0",
    "saved": None,  # torch's thread count while in decode mode, else None
    "blas_threads": None,  # the count last given to OpenBLAS
    "shutdown_fns": None,  # OpenBLAS's blas_thread_shutdown_, one per library found (looked up once)
}


def use_blas(enabled: bool) -> None:
    """Switch the OpenBLAS one-row path (and decode mode) on or off process-wide."""
    release_threads()
    _state["enabled"] = bool(enabled)


def in_decode_mode() -> bool:
    return _state["saved"] is not None


def mm(x: torch.Tensor, wt: Weight) -> torch.Tensor:
    """x [M, in] @ W [in, out] (+ bias) -> [M, out] contiguous, through the fastest library for M (see above)."""
    M = x.shape[0]
    if M == 1 and _state["saved"] is not None and wt.w_np is not None and x.dtype == torch.float32:
        y = torch.from_numpy(wt.w_np @ x.numpy()[0])[None]  # [1, out]: sgemv over [out, in]
    elif 2 <= M <= SMALL_M:
        y = (wt.w_t @ x.t()).t().contiguous()  # [M, out]
    else:
        return x @ wt.w if wt.bias is None else torch.addmm(wt.bias, x, wt.w)
    return y if wt.bias is None else y + wt.bias


def _set_blas_threads(n: int) -> None:
    """Give OpenBLAS ``n`` threads (threadpoolctl finds NumPy's copy; ~0.5 ms, so only when n changes)."""
    if _state["blas_threads"] != n:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=n, user_api="blas")
        _state["blas_threads"] = n


def _stop_blas_workers() -> None:
    """Join OpenBLAS's worker threads now; its next threaded call starts them again (~0.1 ms).

    Idle OpenBLAS workers spin for 2**28 cycles (~0.1 s) before they sleep (``OPENBLAS_THREAD_TIMEOUT``,
    read only when the library loads, and torch loads NumPy's on import). One of them spinning through a
    5-row verification forward on torch's 2 threads made it 70-110 ms instead of 31. ``blas_thread_shutdown_``
    is the function OpenBLAS itself runs before a fork; a library without it is left as it is.
    """
    if _state["shutdown_fns"] is None:
        from threadpoolctl import ThreadpoolController

        libs = ThreadpoolController().select(internal_api="openblas").lib_controllers
        _state["shutdown_fns"] = [f for lc in libs if (f := getattr(lc.dynlib, "blas_thread_shutdown_", None))]
    for fn in _state["shutdown_fns"]:
        fn()


def release_threads() -> None:
    """Leave decode mode: OpenBLAS's workers stop, torch gets back the thread count it had. A no-op outside
    decode mode."""
    saved, _state["saved"] = _state["saved"], None
    if saved is None:
        return
    _stop_blas_workers()
    if saved != torch.get_num_threads():
        torch.set_num_threads(saved)


def blas_forward(num_rows: int, dtype: torch.dtype, device: torch.device) -> None:
    """Call before a forward of ``num_rows`` new tokens: one row of fp32 on the CPU enters decode mode
    (torch on 1 thread, OpenBLAS on torch's threads), anything else leaves it."""
    if num_rows != 1 or dtype != torch.float32 or device.type != "cpu" or not _state["enabled"]:
        release_threads()
        return
    if _state["saved"] is None:
        n = torch.get_num_threads()
        _set_blas_threads(n)
        _state["saved"] = n
        if n > 1:
            torch.set_num_threads(1)
