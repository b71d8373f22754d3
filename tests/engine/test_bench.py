"""The engine benchmark's harness runs (its figures are for experiments/LOG.md, not asserted here)."""

from specdec.engine import bench


def test_bench_reports_every_case_on_the_tiny_model(capsys):
    res = bench.bench("tiny-random-llama", context=24, reps=1)
    assert set(res["M"]) == set(bench.M_CASES) and set(res["B"]) == set(bench.B_CASES)
    assert res["bytes"] > 0 and all(lo > 0 for lo, _ in res["M"].values())
    bench._table(res, bench.read_rate_gbs(res["bytes"]), "tiny", bench.gemm_gflops("float32", 256, 1))
    out = capsys.readouterr().out
    assert "M=33" in out and "B=16" in out and "limit:" in out and "roofline" in out


def test_roofline_names_the_binding_limit():
    res = {"M": {1: (2.0, 2.0), 64: (9.0, 9.0)}, "bytes": 1_000_000, "params": 250_000}
    rows = bench.roofline(res, rate_gbs=1.0, gflops=10.0)  # bytes-bound 1 ms; flops-bound 0.05 ms per row
    assert [r[4] for r in rows] == ["bytes", "flops"]
    assert rows[1][3] == 2 * 64 * 250_000 / 10.0 / 1e6
