"""experiments/bench/flagship_table.py: the figures of a fabricated summary.json, worked by hand."""

import json

import pytest

from experiments.bench.flagship_table import main, row


def summary(**over) -> dict:
    # a depth-3 tree: acceptance at depths 1..3 (k = 3); t(1) = 40 ms, propose 9 ms, score 50 ms
    s = dict(config={"proposer": {"_target_": "proposers.eagle3.Eagle3Proposer",
                                  "options": {"ngram_branch": 3}},
                     "scorer": {"tree_depth": 3, "tree_topk": 3, "tree_budget": 6}},
             acceptance_per_position=[0.7, 0.4, 0.2], mean_acceptance_length=2.3,
             step_time_s={"propose": 0.009, "score": 0.050, "verify": 0.002, "step": 0.062},
             baseline_step_time_s={"step": 0.040}, speedup=1.5, speedup_ci95=[1.4, 1.6], predicted_speedup=None)
    s.update(over)
    return s


def test_row_is_the_theory_worked_by_hand():
    r = row(summary())
    # v = 50 / 40 = 1.25; c = 9 / 3 / 40 = 0.075, k c = 0.225; predicted = 2.3 / 1.475
    assert r["k"] == 3
    assert r["t1_ms"] == pytest.approx(40.0)
    assert r["draft_ms"] == pytest.approx(9.0) and r["draft_ms_per_depth"] == pytest.approx(3.0)
    assert r["score_ms"] == pytest.approx(50.0) and r["verify_ms"] == pytest.approx(2.0)
    assert r["predicted"] == pytest.approx(2.3 / 1.475)
    assert r["efficiency"] == pytest.approx(1.5 * 1.475 / 2.3)  # measured / predicted
    assert r["experiment"] == "Eagle3Proposer 3x3x6+ngram3"


def test_a_branch_past_the_depth_keeps_the_draft_per_depth():
    """A 6-token n-gram branch on a depth-3 tree: six acceptance positions, the draft still three head depths."""
    r = row(summary(acceptance_per_position=[0.7, 0.4, 0.2, 0.1, 0.05, 0.05], mean_acceptance_length=2.5))
    assert r["k"] == 6 and r["draft_ms_per_depth"] == pytest.approx(3.0)
    assert r["predicted"] == pytest.approx(2.5 / (1.25 + 0.225))  # the whole draft, whatever k: 9 / 40


def test_a_run_without_baseline_or_speculation_has_no_prediction():
    r = row(summary(baseline_step_time_s={}, speedup=None, speedup_ci95=None))
    assert r["predicted"] is None and r["efficiency"] is None and r["t1_ms"] is None
    plain = row(summary(acceptance_per_position=[], step_time_s={"step": 0.04}, config={}))
    assert plain["k"] == 0 and plain["predicted"] is None and plain["draft_ms_per_depth"] is None


def test_main_prints_markdown_and_flags_a_disagreeing_summary(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary(predicted_speedup=1.0)))  # not 2.3 / 1.475 = 1.559
    main(["--markdown", str(run)])
    out = capsys.readouterr()
    line = out.out.splitlines()[2]
    assert "| 40.00 | 9.00 | 3.00 | 50.00 | 2.00 | 2.300 | 1.56 | 1.50 [1.40, 1.60] | 0.96 |" in line
    assert "recomputed 1.5593 but the summary says 1.0000" in out.err
