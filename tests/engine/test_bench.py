"""The engine benchmark's harness runs (its figures are for experiments/LOG.md, not asserted here)."""

from specdec.engine import bench


def test_bench_reports_every_case_on_the_tiny_model(capsys):
    res = bench.bench("tiny-random-llama", context=24, reps=1)
    assert set(res["M"]) == set(bench.M_CASES) and set(res["B"]) == set(bench.B_CASES)
    assert res["bytes"] > 0 and all(lo > 0 for lo, _ in res["M"].values())
    bench._table(res, bench.read_rate_gbs(res["bytes"]), "tiny")
    out = capsys.readouterr().out
    assert "M=33" in out and "B=16" in out and "limit:" in out
