"""experiments/bench/policy.py on the tiny model (1 prompt per category, 12 tokens, batch 3): both tables and the
JSON report are written, and every config's tokens equal plain decoding's. The figures for experiments/LOG.md come
from SmolLM2 on a quiet machine, not from here."""

import json

from experiments.bench.policy import main


def test_the_bench_runs_and_every_config_is_greedy_equal(tmp_path, capsys):
    out = tmp_path / "policy.json"
    res = main(["--model", "tiny-random-llama", "--categories", "summarization,coding", "--per-category", "1",
                "--max-tokens", "12", "--batch", "3", "--threads", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert "| goodput |" in text and "batch 3 (all submitted at once)" in text
    assert json.loads(out.read_text())["batch1"].keys() == {"plain", "static", "goodput"}
    for part in ("batch1", "batch"):
        assert all(r["greedy_mismatches"] == 0 for r in res[part].values()), res[part]
    assert res["batch1"]["static"]["mean_chosen_k"] == 10  # static: the configured k every step


def test_all_categories(tmp_path, capsys):
    res = main(["--model", "tiny-random-llama", "--categories", "all", "--per-category", "1", "--max-tokens", "4",
                "--batch", "1", "--threads", "1", "--out", str(tmp_path / "p.json")])
    assert len(res["batch1"]["plain"]["per_category"]) == 13 + 1  # Spec-Bench's 13 and the overall
    assert "| goodput |" in capsys.readouterr().out and (tmp_path / "p.json").exists()


def test_the_aa_config_is_plain_run_again_beside_the_others(tmp_path, capsys):
    res = main(["--model", "tiny-random-llama", "--categories", "coding", "--per-category", "2", "--max-tokens", "6",
                "--batch", "1", "--threads", "1", "--aa"])
    assert list(res["batch1"]) == ["plain", "static", "goodput", "plain_again"]
    again = res["batch1"]["plain_again"]
    assert again["greedy_mismatches"] == 0 and again["mean_chosen_k"] is None  # plain decoding: nothing drafted
    assert "| plain_again |" in capsys.readouterr().out
