"""experiments/bench/lm_screen_vnni.cpp (the prototype behind lm_screen_speed.py) against a torch reference of the
same arithmetic: int8 weights in groups with one scale per output and group, x quantised to uint8 with zero point 128,
exact int32 sums per group. Skipped where the CPU has no avx512_vnni."""

from __future__ import annotations

import ctypes

import pytest
import torch

from specdec.engine.cpu.build import cpu_flags

pytestmark = pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="needs a CPU with avx512_vnni")


def test_the_vnni_screen_equals_its_reference(tmp_path):
    from experiments.bench.lm_screen_speed import build

    lib = build(tmp_path)
    g = torch.Generator().manual_seed(0)
    V, K, G, M = 64, 128, 64, 11  # 11 rows: a block of 8 and one of 3
    q = torch.randint(-127, 128, (V, K // G, G), generator=g, dtype=torch.int8)
    s = torch.rand(V, K // G, generator=g) * 0.01 + 1e-3  # [V, K/G]
    xq = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
    xs = torch.rand(M, generator=g) + 0.5  # [M]
    corr = 128 * q.to(torch.int32).sum(-1)  # [V, K/G]
    qp = q.view(V // 16, 16, K // 4, 4).transpose(1, 2).contiguous()  # [V/16, K/4, 16, 4]
    scp = s.view(V // 16, 16, K // G).transpose(1, 2).contiguous()
    cpp = corr.view(V // 16, 16, K // G).transpose(1, 2).contiguous().to(torch.int32)
    out = torch.empty(M, V)
    P = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    lib.screen_vnni(P(qp), P(cpp), P(scp), ctypes.c_int64(V), ctypes.c_int64(K), ctypes.c_int64(G), P(xq), P(xs),
                    ctypes.c_int64(M), P(out))
    sums = torch.einsum("mgk,vgk->mvg", (xq.to(torch.int64) - 128).view(M, K // G, G),
                        q.to(torch.int64))  # [M, V, K/G] exact integer sums per group
    terms = sums.double() * s.double()[None] * xs.double()[:, None, None]  # [M, V, K/G]
    ref = terms.sum(-1)  # [M, V]
    # fp32 rounding of each group's term and of their sum: a few ulps of the terms' magnitudes (they may cancel)
    assert ((out.double() - ref).abs() <= 1e-6 * terms.abs().sum(-1) + 1e-12).all()
