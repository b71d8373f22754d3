"""Every build of the kernels this CPU can run gives the same products as the reference (the AVX2 and
generic builds are how a machine without AVX-512 runs), and the ISA choice follows the CPU's flags."""

from __future__ import annotations

import ctypes

import pytest
import torch

from specdec.engine.cpu import build, ops

V4 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16"}


def test_choose_isa_from_flags(monkeypatch):
    monkeypatch.delenv("SPECDEC_CPU_ISA", raising=False)
    if build.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    assert build.choose_isa(V4 | {"avx2", "fma", "f16c", "bmi2", "movbe"}) == "avx512bf16"
    assert build.choose_isa(V4 | {"avx2", "fma", "amx_tile", "amx_bf16"}) == "amx"
    assert build.choose_isa(V4 | {"amx_tile"}) == "avx512bf16"  # tiles without their bf16 product
    assert build.choose_isa({"avx2", "fma", "f16c", "bmi2", "movbe", "avx512f"}) == "avx2"
    assert build.choose_isa({"sse2"}) == "generic"
    monkeypatch.setenv("SPECDEC_CPU_ISA", "nope")
    with pytest.raises(ValueError, match="SPECDEC_CPU_ISA='nope'"):
        build.choose_isa()


def _runnable() -> list[str]:
    flags = build.cpu_flags()
    out = ["generic"]
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    if V4 <= flags:
        out.append("avx512bf16")
    if V4 | {"amx_tile", "amx_bf16"} <= flags:
        out.append("amx")
    return out


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512bf16", "amx"])
def test_every_build_matches_reference(isa):
    if isa not in _runnable():
        pytest.skip(f"this CPU cannot run the {isa} build")
    so, why = build.load(isa)
    assert so is not None, why
    if isa == "amx" and not so.sd_ready():
        pytest.skip("the OS refused AMX's tile state")
    assert so.sd_isa() == {"generic": 0, "avx2": 1, "avx512bf16": 2, "amx": 3}[isa]
    ops.declare(so)
    g = torch.Generator().manual_seed(1)
    M, N, K = 6, 9, 64
    x = torch.randn(M, K, generator=g)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        w = (torch.randn(N, K, generator=g) / 8).to(dt)
        code = ops.WDTYPES[dt]
        n = so.sd_pack(code, w.data_ptr(), N, K, None)
        packed = torch.empty(n, dtype=dt)
        so.sd_pack(code, w.data_ptr(), N, K, packed.data_ptr())
        desc = ops.SdWeight(packed.data_ptr(), None, N, K, code, 1)
        y = torch.empty(M, N)
        xb = torch.empty(M, K, dtype=torch.int16)  # held: the kernel writes x as bf16 into it
        so.sd_linear(ctypes.byref(desc), ops.fptr(x), M, ops.fptr(y), 0, xb.data_ptr())
        xr = x.bfloat16().float() if (dt == torch.bfloat16 and isa in build.BF16_ISAS) else x
        torch.testing.assert_close(y, ops.linear_ref(xr, w), atol=2e-5, rtol=1e-5)
