"""experiments/bench/baseline.py on the real model: the three decoders run the same prompts, and the in-run
baseline emits the plain LLM's tokens (greedy)."""

import pytest

from experiments.bench import baseline as bench_baseline


@pytest.mark.slow
def test_bench_baseline_runs_the_three_decoders():
    res = bench_baseline.main(["--experiment", "eagle", "--prompts-per-category", "1", "--max-new-tokens", "8"])
    assert res["prompts"] == 8 and res["same_plain_tokens"]
    assert set(res["tokens_per_s"]) == {"plain", "in_run_baseline", "speculative"}
    assert all(v > 0 for v in res["tokens_per_s"].values())
