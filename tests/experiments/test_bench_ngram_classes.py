"""experiments/bench/ngram_classes.py: the table's arithmetic on hand-made outputs, and a run on the tiny model."""

import pytest

from experiments.bench.ngram_classes import accepted, main, tabulate


def test_the_table_counts_each_position_by_its_match_length():
    # prompt [1, 2, 3, 1, 2]; output [3, 9, 3]: at t=1 the tokens end "... 1, 2, 3" -> the 3-gram [1, 2, 3] matched at
    # 0..2, draft [1, 2, 3] against the output's next [9, 3]: 0 accepted; at t=2 they end "3, 9": 9 never occurred
    # before -> no match (n = 0)
    rows = [("x", [1, 2, 3, 1, 2], [3, 9, 3])]
    res = tabulate(rows, k=3, min_n=1, max_n=3)
    assert set(res["by_n"]) == {0, 3}
    assert res["by_n"][3]["positions"] == 1 and res["by_n"][3]["mean_accepted"] == 0
    assert res["by_n"][0]["share"] == pytest.approx(0.5)
    # a continuation that repeats the prompt: the 3-gram drafts are right, 2 of 2 at t = 1..3; at t = 4 the draft
    # [8, 5] meets the output's last token 8 alone: 1
    rows = [("y", [5, 6, 7, 8, 5, 6, 7], [8, 5, 6, 7, 8])]
    res = tabulate(rows, k=2, min_n=1, max_n=3)
    assert res["by_n"][3]["mean_accepted"] == 1.75 and res["by_n"][3]["p_at_least"] == [1.0, 0.75]
    assert list(res["by_n"]) == [3] and res["by_category"]["y"][3] == 1.75
    assert accepted([1, 2, 3], [1, 2, 4]) == 2 and accepted([], [1]) == 0


def test_a_run_on_the_tiny_model(capsys):
    res = main(["--model", "tiny-random-llama", "--categories", "summarization,rag", "--per-category", "1",
                "--max-tokens", "12", "--threads", "1"])
    assert "| n | share of positions" in capsys.readouterr().out
    assert sum(s["positions"] for s in res["by_n"].values()) >= 2  # a position per output token past the first
    assert sum(s["share"] for s in res["by_n"].values()) == pytest.approx(1.0)
    assert set(res["by_category"]) == {"summarization", "rag"}
