"""experiments/bench/serving.py against a live tiny server: Poisson arrivals, per-request TTFT/TPOT/ITL,
the per-rate summary (throughput, goodput, percentiles, core busy share) and its table and plot."""

import asyncio
import math

import pytest

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


def test_check_holds_a_mode_against_the_best_other():
    def row(rate, tput, tpot):
        return {"rate": rate, "throughput_tok_s": tput, "tpot_p50": tpot}

    rows = {"off": [row(1, 100, 0.02), row(2, 100, 0.05), row(math.inf, 200, 0.08)],
            "ngram": [row(1, 120, 0.015), row(2, 90, 0.06), row(math.inf, 150, 0.10)],
            "goodput": [row(1, 118, 0.0152), row(2, 105, 0.045), row(math.inf, 210, 0.07)]}
    v = bench.check(rows, "goodput")
    assert [r["within"] for r in v["rates"]] == [True, True, True]  # 118 >= 0.97 x 120, 0.0152 <= 1.03 x 0.015
    assert [r["above"] for r in v["rates"]] == [False, True, True] and v["met"]
    assert "rate 1: tokens/s x0.983" in v["text"] and v["text"].endswith("above every other at 2 rates")
    rows["goodput"][2] = row(math.inf, 190, 0.07)  # 5% below off's throughput at the saturated rate
    v = bench.check(rows, "goodput")
    assert not v["met"] and not v["rates"][2]["within"] and "BELOW" in v["text"]


def test_repeated_runs_merge_into_medians_with_their_spread():
    def row(tput, tpot, errors=()):
        return {"rate": 2.0, "completed": 6, "errors": len(errors), "throughput_tok_s": tput, "tpot_p50": tpot,
                "error_examples": list(errors)}

    one = row(100.0, 0.05)
    assert bench.merge([one]) is one  # a single run stays as it was
    m = bench.merge([row(100.0, 0.05), row(90.0, 0.06, ["boom"]), row(110.0, 0.04)])
    assert m["throughput_tok_s"] == 100.0 and m["tpot_p50"] == 0.05 and m["repeats"] == 3 and m["rate"] == 2.0
    assert m["runs_tpot_p50"] == [0.05, 0.06, 0.04] and m["spread_tpot_p50"] == pytest.approx(0.5)
    assert m["spread_throughput_tok_s"] == pytest.approx(110 / 90 - 1) and m["error_examples"] == ["boom"]
    rows = {"off": [m], "goodput": [bench.merge([row(101.0, 0.049), row(99.0, 0.051)])]}
    v = bench.check(rows, "goodput")
    assert v["rates"][0]["within"] and "medians of 2 runs; TPOT p50 spread 4% here, 50% for off" in v["text"]
