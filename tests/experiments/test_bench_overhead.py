"""experiments/bench/overhead.py on the tiny model: every N's tokens equal N = 1's, the cells are medians over the
reps, and the batch-1 verdict compares the tokens/s gained with the overhead saved. Figures for experiments/LOG.md
come from SmolLM2 on a quiet machine, not from here."""

import pytest

from experiments.bench.overhead import cell, main, verdict


def test_cell_takes_medians_and_the_spread():
    runs = [(1.0, 100, {"score": 0.8, "propose": 0.1, "execute": 0.95}, [1]),
            (3.0, 100, {"score": 2.0, "propose": 0.1, "execute": 2.9}, [1]),
            (2.0, 100, {"score": 1.5, "propose": 0.1, "execute": 1.9}, [1])]
    c = cell(runs, "ngram", 1, 8, 20.0)
    assert c["ms_per_token"] == pytest.approx(20.0) and c["tokens_per_s"] == pytest.approx(50.0)
    assert c["model_ms_per_token"] == pytest.approx(16.0)  # median of 9, 21, 16
    assert c["overhead_ms_per_token"] == pytest.approx(4.0)  # median of 1, 9, 4
    assert (c["ms_per_token_min"], c["ms_per_token_max"]) == pytest.approx((10.0, 30.0))


def test_verdict_wants_the_gain_at_least_the_saving():
    ref = dict(tokens_per_s=100.0, ms_per_token=10.0, overhead_ms_per_token=1.0)
    saved_03 = dict(tokens_per_s=1e3 / 9.7, ms_per_token=9.7, overhead_ms_per_token=0.3, overhead_ratio=0.3)
    v = verdict(ref, saved_03)
    assert v["saved_pct"] == pytest.approx(7.0) and v["gain_pct"] == pytest.approx(3.09, abs=0.01) and not v["met"]
    full = dict(tokens_per_s=1e3 / 9.3, ms_per_token=9.3, overhead_ms_per_token=0.3, overhead_ratio=0.3)
    assert verdict(ref, full)["met"]


def test_the_bench_runs_on_the_tiny_model(capsys):
    rows = main(["--model", "tiny-random-llama", "--steps", "1,4", "--batches", "1", "--methods", "plain,ngram",
                 "--tokens", "10", "--reps", "2", "--threads", "1"])
    text = capsys.readouterr().out
    assert "N=4 vs N=1: tok/s" in text and "median of 2" in text
    assert [(r["method"], r["steps"]) for r in rows] == [("plain", 1), ("plain", 4), ("ngram", 1), ("ngram", 4)]
    assert all(r["same"] and r["reps"] == 2 for r in rows)
    assert {"gain_pct", "saved_pct", "met"} <= set(rows[1]) and {"gain_pct", "saved_pct", "met"} <= set(rows[3])
