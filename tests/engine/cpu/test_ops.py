"""The CPU kernels against their torch references (ops.py), in every build this CPU can run, and the
invariance of a product's rows to M."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.cpu import build, ops

pytestmark = pytest.mark.skipif(ops.lib() is None, reason=f"native kernels unavailable: {build.status()}")

# (M, N, K): SmolLM2's shapes, an unpackable K (37: scalar tails), balanced tiles (7 = 4 + 3, 13 = 5 + 4 + 4 on
# AVX2), talls M (70, 101 > MC = 48 rows per block: blocks of 48 + 22, 48 + 48 + 5) with several panels, so
# the next-panel prefetch runs off the end of the weight; on the amx build (K % 32 == 0) row tiles that overlap
# (34 = 12 + 12 + 10 rows as 3 tiles of 12, the last from row 22), two full tiles (48 = 16 x 3), 20 = 10 + 10
SHAPES = [(1, 960, 576), (5, 3072, 64), (7, 960, 576), (13, 200, 96), (17, 576, 96), (33, 67, 64), (3, 7, 37),
          (70, 10, 64), (101, 50, 40), (34, 100, 128), (48, 64, 32), (20, 33, 160), (64, 40, 96)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _x_as_kernel_sees(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    # with vdpbf16ps (avx512bf16 build) a bf16 product rounds x to bf16 first; other builds widen W instead
    return x.bfloat16().float() if dt == torch.bfloat16 and build.choose_isa() in build.BF16_ISAS else x


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_matches_reference_and_is_row_invariant(dt, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K, generator=g)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dt)
    b = torch.randn(N, generator=g)
    nw = ops.NativeWeight(w, b)
    y = ops.linear(x, nw)
    torch.testing.assert_close(y, ops.linear_ref(_x_as_kernel_sees(x, dt), w, b), atol=2e-5, rtol=1e-5)
    alone = torch.cat([ops.linear(x[i : i + 1], nw) for i in range(M)])
    assert torch.equal(alone, y)  # each row as if it were the only one
    acc = torch.randn(M, N, generator=g)
    expect = acc + y
    ops.linear(x, nw, out=acc)
    assert torch.equal(acc, expect)  # the fused residual add is a plain add after the product


def test_rmsnorm_and_silu_match_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-5), ops.rmsnorm_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    gu = torch.randn(5, 2 * 96, generator=g) * 6  # wide range: exp's polynomial at both ends
    torch.testing.assert_close(ops.silu_mul(gu), ops.silu_mul_ref(gu), atol=1e-5, rtol=1e-5)


def test_linear_rejects_bad_shapes():
    nw = ops.NativeWeight(torch.randn(4, 8))
    with pytest.raises(ValueError, match="linear: x"):
        ops.linear(torch.randn(2, 9), nw)
    with pytest.raises(ValueError, match="contiguous float32"):
        ops.linear(torch.randn(2, 8).double(), nw)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_stats_are_the_rows_argmax_logsumexp_and_finiteness(dt, M, N, K):
    """``linear_stats`` writes the same product as ``linear`` and, per row, torch's argmax (the first maximum), the
    logsumexp and finiteness, whatever M (a row's figures are its own); packed and unpacked weights alike."""
    g = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g) * 3
    nw = ops.NativeWeight((torch.randn(N, K, generator=g) / K**0.5).to(dt))
    y, amax, lse, finite = ops.linear_stats(x, nw)
    assert torch.equal(y, ops.linear(x, nw)) and finite.all()
    ref_amax, ref_lse, _ = ops.linear_stats_ref(y)
    assert torch.equal(amax, ref_amax)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-6)
    y1, a1, l1, _ = ops.linear_stats(x[-1:], nw)
    assert torch.equal(a1, amax[-1:]) and torch.equal(l1, lse[-1:])


def test_linear_stats_ties_and_non_finite_rows():
    """Equal maxima in different panels (and so, with two threads, different threads' halves): the first index
    wins, as torch.argmax; a row with a NaN or an infinity is flagged and the others keep their figures."""
    w = torch.zeros(300, 4)
    w[[7, 42, 299], :] = 1.0
    y, amax, lse, finite = ops.linear_stats(torch.ones(2, 4), ops.NativeWeight(w))
    assert amax.tolist() == [7, 7] and finite.all()
    torch.testing.assert_close(lse, torch.logsumexp(y, -1))
    big = torch.randn(300, 4, generator=torch.Generator().manual_seed(1))
    big[5] = torch.tensor([1e38, 0.0, 0.0, 0.0])  # output 5 overflows to inf in a row whose x[0] is large
    x = torch.tensor([[0.0, 1.0, -1.0, 0.5], [float("nan"), 0.0, 0.0, 0.0], [1e3, 0.0, 0.0, 0.0]])
    y, amax, lse, finite = ops.linear_stats(x, ops.NativeWeight(big))
    assert finite.tolist() == [True, False, False]
    assert int(amax[0]) == int(y[0].argmax())


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=str)
def test_linear_stats_do_not_depend_on_the_thread_count(dt):
    """engine/cpu/threads.py changes the thread count while the machine is busy: the product, argmax and logsumexp of
    every row are bit for bit those of any other thread count (fixed panel groups, merged in group order)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=g) * 3
    nw = ops.NativeWeight((torch.randn(5000, 96, generator=g) / 96**0.5).to(dt))  # > 64 groups' worth of panels
    n = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(ops.linear_stats(x, nw))
    finally:
        torch.set_num_threads(n)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_bf16_products_survive_torch_using_the_tiles_between_them():
    # on the amx build each product loads its own tile configuration; torch's oneDNN (AMX on such a CPU) loads
    # another on the same threads between our calls: the next product must not run on oneDNN's configuration
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 576, generator=g)
    nw = ops.NativeWeight((torch.randn(300, 576, generator=g) / 24).bfloat16())
    first = ops.linear(x, nw)
    a = torch.randn(256, 512, generator=g).bfloat16()
    for _ in range(3):
        (a @ a.T).sum()  # oneDNN bf16 GEMM
        assert torch.equal(ops.linear(x, nw), first)
        assert torch.equal(ops.linear(x[:5], nw), first[:5])
