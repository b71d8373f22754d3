"""Launchers for the CPU kernels (``csrc/kernels.cpp``), each beside a torch reference with its signature.

The launchers check shapes, dtypes and contiguity, then pass raw pointers through ctypes; outputs are fp32.
The references are plain torch and define what the kernels compute (``tests/engine/cpu`` compares the two);
they are not batch-invariant, the kernels are (see the top of kernels.cpp).

This module knows nothing about models or caches beyond the tensors it is handed.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from ctypes import POINTER, c_float, c_int, c_int32, c_int64, c_uint8, c_void_p

import torch
import torch.nn.functional as F

from specdec.engine.cpu import hugepages
from specdec.engine.cpu.build import load

__all__ = [
    "NativeWeight", "SdCache", "SdDraftHead", "SdLayer", "SdModel", "SdRows", "SdScratch", "SdWeight", "WDTYPES", "attention_copies", "lib",
    "linear", "linear_ref", "sd_cache",
    "linear_stats", "linear_stats_ref",
    "rmsnorm", "rmsnorm_ref", "silu_mul", "silu_mul_ref",
]  # fmt: skip

WDTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # weight dtypes the kernels read
_fp = POINTER(c_float)
_ip = POINTER(c_int64)


class SdRows(ctypes.Structure):  # mirrors kernels.cpp: what each of the T new tokens is
    _fields_ = [
        ("T", c_int64), ("slot", _ip), ("start", _ip), ("index", _ip), ("nnew", _ip),
        ("mask", POINTER(c_uint8)), ("mask_stride", c_int64), ("cos", _fp), ("sin", _fp), ("kt_valid", _ip),
    ]  # fmt: skip


class SdCache(ctypes.Structure):  # one layer's K and V, [S, nkv, L, hd] fp32 each, and the kernels' copies (kt, vh)
    _fields_ = [
        ("k", _fp), ("v", _fp), ("S", c_int64), ("nkv", c_int64), ("L", c_int64), ("hd", c_int64), ("kt", c_void_p),
        ("Lt", c_int64), ("vh", c_void_p),
    ]  # fmt: skip


def attention_copies(
    shape: tuple[int, ...], weight_dtype: torch.dtype, layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernels' own copies of a layer cache of ``shape`` = (S, nkv, L, hd) (kernels.cpp, ``SdCache``), zeroed,
    filled lazily by the attention from the cache's K and V. -> (kt, vh):
    - kt [*layers, S, nkv, Lt, hd]: K in blocks of VL keys (Lt = L rounded up to VL, each VL keys' rows one block);
    - vh [*layers, S, nkv, L, hd] or None: V rounded to bf16.
    bf16 (kt's keys rounded to bf16 and scored with vdpbf16ps against the query rounded alike, and vh: a bf16 model's
    attention, at half the bytes) where this build has AVX512_BF16 and the weights are bf16; else kt fp32, vh None."""
    S, nkv, L, hd = shape
    vl = _need().sd_vl()
    bf16 = weight_dtype == torch.bfloat16 and _need().sd_isa() >= 2 and hd % 2 == 0
    kt = torch.zeros(*layers, S, nkv, (L + vl - 1) // vl * vl, hd, dtype=torch.int16 if bf16 else torch.float32)
    return kt, torch.zeros(*layers, S, nkv, L, hd, dtype=torch.int16) if bf16 else None


def sd_cache(k: torch.Tensor, v: torch.Tensor, kt: torch.Tensor, vh: torch.Tensor | None) -> SdCache:
    """The ``SdCache`` of one layer: k, v [S, nkv, L, hd] fp32 and that layer's ``attention_copies``."""
    return SdCache(fptr(k), fptr(v), *k.shape, kt.data_ptr(), kt.shape[2], None if vh is None else vh.data_ptr())


class SdWeight(ctypes.Structure):  # one projection: packed (see kernels.cpp) or [N, K] row-major
    _fields_ = [
        ("data", c_void_p), ("bias", _fp), ("N", c_int64), ("K", c_int64), ("dtype", c_int32), ("packed", c_int32),
    ]  # fmt: skip


class SdLayer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _fp), ("wqkv", SdWeight), ("wo", SdWeight), ("ffn_norm", _fp), ("w13", SdWeight),
        ("w2", SdWeight), ("cache", SdCache),
    ]  # fmt: skip


class SdModel(ctypes.Structure):
    _fields_ = [("D", c_int64), ("I", c_int64), ("nh", c_int64), ("nkv", c_int64), ("hd", c_int64), ("eps", c_float)]


class SdDraftHead(ctypes.Structure):  # mirrors csrc/draft_tree.h: an EAGLE head as sd_eagle_tree reads it
    _fields_ = [
        ("kind", c_int32), ("fc", POINTER(SdWeight)), ("w_in", _fp), ("w_hid", _fp), ("w_out", _fp),
        ("lm", POINTER(SdWeight)), ("emb", POINTER(SdWeight)), ("cos", _fp), ("sin", _fp), ("npos", c_int64),
    ]  # fmt: skip


class SdScratch(ctypes.Structure):
    _fields_ = [
        ("h", _fp), ("qkv", _fp), ("att", _fp), ("gu", _fp), ("act", _fp), ("xb", POINTER(ctypes.c_uint16)),
    ]  # fmt: skip


_lib: list = []  # [library or None], set on first use


def declare(so: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures on a loaded build (ctypes would otherwise pass ints as 32-bit)."""
    so.sd_isa.argtypes, so.sd_isa.restype = [], c_int
    so.sd_ready.argtypes, so.sd_ready.restype = [], c_int
    so.sd_vl.argtypes, so.sd_vl.restype = [], c_int64
    so.sd_pack.argtypes, so.sd_pack.restype = [c_int32, c_void_p, c_int64, c_int64, c_void_p], c_int64
    so.sd_unpack.argtypes, so.sd_unpack.restype = [c_int32, c_void_p, c_int64, c_int64, _ip, c_int64, c_void_p], None
    so.sd_linear.argtypes = [POINTER(SdWeight), _fp, c_int64, _fp, c_int, c_void_p]
    so.sd_rmsnorm.argtypes = [_fp, _fp, _fp, c_int64, c_int64, c_float]
    so.sd_silu_mul.argtypes = [_fp, _fp, c_int64, c_int64]
    so.sd_forward.argtypes = [
        POINTER(SdModel), POINTER(SdLayer), c_int64, POINTER(SdRows), _fp, POINTER(SdScratch), c_void_p,
    ]  # fmt: skip
    so.sd_layer_from.argtypes = [POINTER(SdModel), POINTER(SdLayer), POINTER(SdRows), _fp, _fp, POINTER(SdScratch)]
    so.sd_eagle3_step.argtypes = [
        POINTER(SdModel), POINTER(SdLayer), POINTER(SdRows), POINTER(SdWeight), _fp, _fp, _fp, _fp, _fp, _fp, _ip,
        c_int64, _fp, POINTER(SdWeight), _fp, POINTER(SdScratch),
    ]  # fmt: skip
    so.sd_eagle1_step.argtypes = [
        POINTER(SdModel), POINTER(SdLayer), POINTER(SdRows), POINTER(SdWeight), _fp, _fp, _fp, _fp, _ip, c_int64,
        POINTER(SdWeight), _fp, POINTER(SdScratch),
    ]  # fmt: skip
    try:  # a build of an older revision (experiments/bench/kernel_revs.py) has no tree call, or one without the
        tree = so.sd_eagle_tree  # catch-up (before 2026-11-28 13:00): declared here, but only this revision's calls it
    except AttributeError:
        tree = None
    if tree is not None:
        tree.argtypes = [  # arrays as addresses (c_void_p): ~0.2 ms of pointer casts a call less at batch 1
            POINTER(SdModel), POINTER(SdLayer), POINTER(SdDraftHead), c_int64, c_void_p, c_void_p, c_void_p,  # slot..qlen
            c_void_p, c_void_p, c_int64, c_void_p,  # the catch-up's emb, feat, its width, pos
            c_int64, c_int64, c_int64, c_void_p, POINTER(SdScratch),  # depth, topk, budget, kt_valid, scratch
            c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,  # last, root_logits, tok, par, score, rank
        ]  # fmt: skip
        tree.restype = c_int64
    so.sd_linear_stats.argtypes = [POINTER(SdWeight), _fp, c_int64, _fp, c_void_p, _ip, _fp, POINTER(c_uint8)]
    for fn in ("sd_linear", "sd_rmsnorm", "sd_silu_mul", "sd_forward", "sd_layer_from", "sd_eagle3_step", "sd_eagle1_step",
               "sd_linear_stats"):
        getattr(so, fn).restype = None
    return so


def lib() -> ctypes.CDLL | None:
    """The loaded library for this CPU with its signatures declared, or None (see ``build.load``;
    ``SPECDEC_NATIVE=0`` is read on every call, so a test or a comparison can switch it)."""
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return None
    if not _lib:
        so, _ = load()
        _lib.append(None if so is None else declare(so))
    return _lib[0]


def fptr(t: torch.Tensor | None):
    """A float* to a contiguous fp32 CPU tensor (NULL for None)."""
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"CPU kernels: need a contiguous float32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return ctypes.cast(t.data_ptr(), _fp)


def _need() -> ctypes.CDLL:
    so = lib()
    if so is None:
        raise RuntimeError(f"CPU kernels unavailable ({load()[1]}); use the *_ref functions or install g++")
    return so


# ---- products --------------------------------------------------------------------------------------
class NativeWeight:
    """A projection as the kernels read it: the packed copy of ``w`` [N, K] (the only copy kept: ``w`` and
    ``rows(ids)`` unpack it on demand) and bias [N] fp32. Built once at load. A K the packing refuses keeps ``w``
    as it is."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        so = _need()
        if w.dim() != 2 or w.dtype not in WDTYPES or w.device.type != "cpu":
            raise ValueError(f"NativeWeight: w {tuple(w.shape)} {w.dtype} on {w.device}; need [N, K] on the CPU in {list(WDTYPES)}")
        N, K = w.shape
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"NativeWeight: bias {tuple(bias.shape)}; expected [{N}]")
        w = w.contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.dtype = w.dtype
        dt = WDTYPES[w.dtype]
        n = so.sd_pack(dt, w.data_ptr(), N, K, None)
        self.packed = None
        if n:
            self.packed = hugepages.empty(n, w.dtype)  # the stream a forward reads: on 2 MB pages where offered
            so.sd_pack(dt, w.data_ptr(), N, K, self.packed.data_ptr())
        self._w = None if self.packed is not None else w  # the plain copy only where nothing is packed
        data = w if self.packed is None else self.packed
        self.desc = SdWeight(data.data_ptr(), fptr(self.bias), N, K, dt, int(self.packed is not None))
        self.shape = (N, K)
        self._unpacked = None  # weakref to the last full unpacking, shared while someone holds it

    @property
    def nbytes(self) -> int:
        """Bytes of weight data held (the packed copy, or the plain one where nothing packs)."""
        t = self.packed if self.packed is not None else self._w
        return t.numel() * t.element_size()

    def rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` [R] (int64; None: all N) of the [N, K] weight, unpacked into a new [R, K] tensor."""
        N, K = self.shape
        if self.packed is None:
            return (self._w if ids is None else self._w[ids]).clone()
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
            bad = ids.dim() != 1
            if not bad and ids.numel():
                v = ids.tolist() if ids.numel() <= 256 else None  # a draft step's few ids: a list, two reductions fewer
                lo, hi = (min(v), max(v)) if v is not None else (int(ids.min()), int(ids.max()))
                bad = lo < 0 or hi >= N
            if bad:
                raise ValueError(f"NativeWeight.rows: ids must be a 1-d tensor of rows in [0, {N})")
        R = N if ids is None else ids.numel()
        out = torch.empty(R, K, dtype=self.dtype)
        _need().sd_unpack(WDTYPES[self.dtype], self.packed.data_ptr(), N, K,
                          None if ids is None else ctypes.cast(ids.data_ptr(), _ip), R, out.data_ptr())
        return out

    @property
    def w(self) -> torch.Tensor:
        """The [N, K] weight, unpacked on demand (one tensor shared while a caller holds it, then freed)."""
        if self._w is not None:
            return self._w
        w = None if self._unpacked is None else self._unpacked()
        if w is None:
            w = self.rows()
            self._unpacked = weakref.ref(w)
        return w

    def __deepcopy__(self, memo) -> NativeWeight:  # the descriptor holds raw pointers: repack a copy
        return NativeWeight(self.w.clone(), None if self.bias is None else self.bias.clone())


def _linear_args(name: str, x: torch.Tensor, w: NativeWeight) -> tuple[int, int, torch.Tensor | None]:
    """(M, N, the kernels' bf16 input scratch [M, K] or None) of a product x [M, K] . w [N, K]^T, x checked."""
    N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{name}: x {tuple(x.shape)} against w [{N}, {K}]")
    M = x.shape[0]
    return M, N, torch.empty(M, K, dtype=torch.int16) if w.dtype == torch.bfloat16 else None


def linear(x: torch.Tensor, w: NativeWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 . w [N, K]^T (+ bias) -> [M, N] fp32. With ``out`` given, adds into it (``out += ...``):
    the residual add fused into the product."""
    so = _need()
    M, N, xb = _linear_args("linear", x, w)
    y = out if out is not None else torch.empty(M, N, dtype=torch.float32)
    if tuple(y.shape) != (M, N):
        raise ValueError(f"linear: out {tuple(y.shape)}; expected [{M}, {N}]")
    so.sd_linear(ctypes.byref(w.desc), fptr(x.contiguous()), M, fptr(y), int(out is not None),
                 None if xb is None else xb.data_ptr())  # fmt: skip
    return y


def linear_stats(x: torch.Tensor, w: NativeWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear(x, w)`` and, per output row, its argmax (the first maximum) [M] int64, logsumexp [M] fp32 and whether
    every value is finite [M] bool (where False, argmax and logsumexp are not set), taken while the kernels write
    the row: an LM head's [M, V] output is evicted by its own weight stream, and reading it back cost ~0.3 ms a
    step (experiments/LOG.md, 2026-11-27)."""
    so = _need()
    M, N, xb = _linear_args("linear_stats", x, w)
    y = torch.empty(M, N, dtype=torch.float32)
    amax, lse, finite = torch.empty(M, dtype=torch.int64), torch.empty(M, dtype=torch.float32), torch.empty(M, dtype=torch.uint8)
    so.sd_linear_stats(ctypes.byref(w.desc), fptr(x.contiguous()), M, fptr(y), None if xb is None else xb.data_ptr(),
                       ctypes.cast(amax.data_ptr(), _ip), fptr(lse), ctypes.cast(finite.data_ptr(), POINTER(c_uint8)))
    return y, amax, lse, finite.view(torch.bool)


def linear_stats_ref(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of ``linear_stats``' row facts of an output y [M, N]: (argmax, logsumexp, finite)."""
    return y.argmax(-1), torch.logsumexp(y, -1), torch.isfinite(y).all(-1)


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of ``linear`` on the plain [N, K] weight."""
    y = F.linear(x, w.float(), None if bias is None else bias.float())
    return y if out is None else out.add_(y)


# ---- per-row ops -------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, D] fp32, w [D] fp32 -> x * rsqrt(mean(x^2) + eps) * w, [M, D] fp32."""
    so = _need()
    M, D = x.shape
    y = torch.empty_like(x)
    so.sd_rmsnorm(fptr(x), fptr(w), fptr(y), M, D, eps)
    return y


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [M, 2I] fp32 (gate then up) -> silu(gate) * up, [M, I] fp32."""
    so = _need()
    M, I2 = gu.shape
    y = torch.empty(M, I2 // 2, dtype=torch.float32)
    so.sd_silu_mul(fptr(gu), fptr(y), M, I2 // 2)
    return y


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- inference modules -------------------------------------------------------------------------------
class NativeLinear(torch.nn.Module):
    """An inference-only stand-in for ``nn.Linear`` (draft heads): the same weight, packed, through
    ``linear``. Input [..., K] of any float dtype; output [..., N] in the input's dtype. For small row counts
    MKL's GEMM read a head's weights at ~1/4 of the memory rate (experiments/LOG.md, 2026-11-23)."""

    def __init__(self, lin: torch.nn.Linear, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        w = lin.weight.detach()
        if weight_dtype is not None:  # e.g. bf16 packing of an fp32 draft head: half the bytes to read
            w = w.to(weight_dtype)
        self.nw = NativeWeight(w.contiguous(), None if lin.bias is None else lin.bias.detach())
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x.reshape(-1, self.in_features).float().contiguous(), self.nw)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def native_linears(module: torch.nn.Module, weight_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (in place) by a ``NativeLinear`` when the kernels are
    available; for inference only (no gradients flow through). ``weight_dtype`` packs the weights in that
    dtype (None: their own). Returns ``module``."""
    if lib() is None:
        return module
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype in WDTYPES:
            setattr(module, name, NativeLinear(child, weight_dtype))
        else:
            native_linears(child, weight_dtype)
    return module
