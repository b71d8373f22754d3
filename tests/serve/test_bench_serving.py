"""experiments/bench/serving.py against a live tiny server: Poisson arrivals, per-request TTFT/TPOT/ITL,
the per-rate summary (throughput, goodput, percentiles, core busy share) and its table and plot."""

import asyncio
import math

from experiments.bench import serving as bench
from specdec.datamodel.metrics import percentiles


def test_percentiles_interpolate():
    assert percentiles([1.0, 2.0, 3.0, 4.0]) == {"p50": 2.5, "p99": 3.97}
    assert math.isnan(percentiles([])["p50"])


def test_bench_rates_against_a_live_server(plain_server, tmp_path):
    prompts = ["hello", "what is 2 + 2?", "name a color"]
    rows = {}
    for mode in ("off", "on"):  # the same server twice: the report's shape, not a comparison
        rows[mode] = []
        for rate in (50.0, float("inf")):
            run = asyncio.run(bench.run_rate(plain_server.url, "tiny-random-llama", prompts, rate, 8, seed=0))
            row = bench.summarize(run, tpot_slo=10.0)
            assert row["completed"] == 3 and row["errors"] == 0 and row["throughput_tok_s"] > 0, row["error_examples"]
            assert row["goodput_req_s"] == row["request_rate"]  # every TPOT is under a 10 s objective
            assert row["ttft_p50"] > 0 and row["tpot_p99"] >= row["tpot_p50"] and 0 < row["core_busy_share"] <= 1.05
            rows[mode].append(row)
    md = bench.table(rows)
    assert md.count("\n") == 5 and "| off | 50 |" in md and "| on | inf |" in md
    bench.plot(rows, tmp_path / "serving.png")
    assert (tmp_path / "serving.png").stat().st_size > 0
