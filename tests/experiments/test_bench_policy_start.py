"""experiments/bench/policy_start.py and spec_prefill.py: the table's line, and a run of each on the tiny model."""

from experiments.bench.policy_start import describe, main
from experiments.bench.spec_prefill import main as prefill_main


def test_the_table_line_gives_each_width_against_one_row():
    assert describe([1, 2, 12], [5.0, 5.5, 12.5]) == "1:5.00 (1.00)  2:5.50 (1.10)  12:12.50 (2.50)"


def test_a_process_on_the_tiny_model_prints_its_table_and_choices(capsys):
    runs = main(["--experiment", "ngram_goodput", "--model", "tiny-random-llama", "--processes", "1", "--prompts", "2",
                 "--max-tokens", "8", "--threads", "1"])
    assert len(runs) == 1 and len(runs[0]) == 3  # the table, then one line per request
    table, reqs = runs[0][0], runs[0][1:]
    assert table["table_rows"][:2] == [1, 2] and all(ms > 0 for ms in table["table_ms"])
    assert all(sum(r["chosen"].values()) >= 1 and r["tokens_per_s"] > 0 for r in reqs)
    assert "process 0: table ms" in capsys.readouterr().out


def test_the_speculative_prefill_is_timed_beside_the_plain_one():
    res = prefill_main(["--experiment", "ngram", "--model", "tiny-random-llama", "--categories", "rag",
                        "--per-category", "2"])
    assert res["prompts"] == 2 and res["plain_ms"] > 0 and res["spec_ms"] > 0
