"""Sweeps: a two-point multirun gives two summaries (one W&B group) and a report whose plots read back."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.experiment.report import report, series_keys, swept_keys
from specdec.experiment.summary import CategorySummary, RunSummary, read_summary, write_summary

def read_png(path: Path):
    from matplotlib.image import imread

    assert path.stat().st_size > 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0  # something is drawn, not a blank canvas
    return img


def test_two_point_multirun_gives_two_summaries_one_group_and_a_report(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(tmp_path / "c"),
           "WANDB_DATA_DIR": str(tmp_path / "d"), "WANDB_CONFIG_DIR": str(tmp_path / "cfg")}
    # the basic launcher runs the two jobs in this process, one after the other (joblib is the default)
    cmd = [sys.executable, "-m", "specdec.run", "-m", "hydra/launcher=basic", "+experiment=ngram", "debug=true",
           "proposer.num_speculative_tokens=1,2", "dataset.categories=[qa]", "logger=wandb",
           f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    paths = sorted(sweep.glob("*/summary.json"))
    assert len(paths) == 2 and str(paths[-1]) == done.stdout.strip().splitlines()[-1]
    ks = [read_summary(p).config["proposer"]["num_speculative_tokens"] for p in paths]
    assert sorted(ks) == [1, 2]
    for p in paths:  # both members carry the sweep's group
        data = next((p.parent / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
        assert "/".join(sweep.parts[-3:]).encode() in data
    assert not (tmp_path / "wandb").exists()  # W&B writes under each run dir, not in the working directory

    out = report(sweep)
    rows = list(csv.DictReader(out["csv"].open()))
    assert [r["proposer.num_speculative_tokens"] for r in rows if r["category"] == "overall"] == ["1", "2"]
    assert {r["category"] for r in rows} == {"overall", "qa"}
    for r in rows:  # the theory beside every row: numbers, since both runs measured a plain baseline
        for f in ("predicted_tau", "verify_cost", "draft_cost", "predicted_speedup", "efficiency"):
            assert float(r[f]) > 0, (f, r)
        assert r["alpha_pos1"] != ""
    for name in ("tau", "speedup", "acceptance", "alpha", "draft_coverage"):
        read_png(out[name])
    table = out["results"].read_text()  # which setting is fastest, with its interval and the why beside it
    assert table.startswith("| run | proposer.num_speculative_tokens | speedup | 95% interval | n | τ | α1")
    assert "Fastest: num_speculative_tokens=" in table and len(table.splitlines()) >= 4


def fake_summary(k: int, method: str, tau: float) -> RunSummary:
    cat = CategorySummary(num_prompts=1, num_generated_tokens=10, mean_acceptance_length=tau, acceptance_rate=0.5,
                          tokens_per_s=10.0, baseline_tokens_per_s=8.0, speedup=1.25, alpha_per_position=[0.8],
                          predicted_tau=tau, verify_cost=1.5, draft_cost=0.1, predicted_speedup=tau / 1.8,
                          efficiency=1.25 / (tau / 1.8))
    return RunSummary(
        config={"proposer": {"method": method, "num_speculative_tokens": k}, "output_dir": f"/x/{k}{method}"},
        num_prompts=2, num_generated_tokens=20, mean_acceptance_length=tau, acceptance_rate=0.5,
        acceptance_per_position=[0.8, 0.5, 0.2][:k], tokens_per_s=10.0, baseline_tokens_per_s=None, speedup=None,
        per_category={"qa": cat, "coding": cat}, greedy_mismatches=0, wall_time_s=1.0)


def test_report_panels_per_other_swept_key_and_checks_x(tmp_path, capsys):
    runs = [(2, "ngram", 1.5), (1, "ngram", 1.2), (3, "layer_skip", 2.0), (1, "layer_skip", 1.4)]
    for i, (k, m, t) in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        write_summary(fake_summary(k, m, t), tmp_path / str(i) / "summary.json")
    assert swept_keys([{"a": 1, "b": "x", "output_dir": 1}, {"a": 2, "b": "y", "output_dir": 2}]) == ["a", "b"]
    # method x k sweep: prompt_lookup_max follows from the method, so it makes no panels of its own
    grid = [{"k": k, "proposer._target_": t, "proposer.prompt_lookup_max": m}
            for t, m in (("ngram", 4), ("bigram", None)) for k in (1, 2)]
    assert series_keys(swept_keys(grid), grid, "k") == ["proposer._target_"]
    from specdec.experiment.report import main

    main([str(tmp_path), "--out", str(tmp_path / "rep")])
    printed = capsys.readouterr().out.split()
    assert printed[0].endswith("report.csv") and printed[1].endswith("results.md")
    # speedup (per category), tau and acceptance have data; alpha (overall) and draft coverage have none: no panel
    assert sorted(Path(x).name for x in printed[2:]) == ["acceptance_per_position.png", "speedup.png", "tau.png"]
    rows = list(csv.DictReader((tmp_path / "rep" / "report.csv").open()))
    assert len(rows) == 4 * 3 and rows[0]["acceptance_pos1"] == "0.8"
    qa = next(r for r in rows if r["category"] == "qa")  # per-category rows carry the theory too
    assert (qa["verify_cost"], qa["draft_cost"], qa["alpha_pos1"]) == ("1.5", "0.1", "0.8")
    assert float(qa["efficiency"]) == pytest.approx(1.25 / (float(qa["predicted_tau"]) / 1.8))
    assert rows[0]["predicted_tau"] == "" and rows[0]["alpha_pos1"] == ""  # overall: not given, left empty
    tau = read_png(tmp_path / "rep" / "tau.png")
    assert tau.shape[1] > 1.5 * tau.shape[0]  # two panels side by side: method=ngram, method=layer_skip
    read_png(tmp_path / "rep" / "speedup.png")  # no overall speedup anywhere: still a readable plot
    with pytest.raises(ValueError, match="--x 'seed' is not a swept key.*num_speculative_tokens"):
        report(tmp_path, tmp_path / "rep2", x="seed")
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        report(tmp_path / "rep")


def test_report_marks_the_interval_and_the_tie(tmp_path):
    """results.md ranks by speedup and names the runs whose interval overlaps the fastest one's; the speedup plot
    draws the intervals; beyond 10 runs every line gets its own colour and marker."""
    from specdec.experiment.report import results_table, style

    for i, (k, sp, ci) in enumerate([(1, 1.10, [1.0, 1.2]), (2, 1.30, [1.2, 1.4]), (4, 1.25, [1.15, 1.35])]):
        s = fake_summary(k, "ngram", 1.5)
        s.speedup, s.speedup_ci95 = sp, ci
        (tmp_path / str(i)).mkdir()
        write_summary(s, tmp_path / str(i) / "summary.json")
    out = report(tmp_path)
    read_png(out["speedup"])
    table = out["results"].read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "run" not in line]
    assert [r.split(" | ")[1] for r in rows] == ["2", "4", "1"]  # fastest first
    assert "Fastest: num_speculative_tokens=2 at 1.30x (95% interval 1.20-1.40x); not distinguishable from it " \
           "on these prompts: num_speculative_tokens=4." in table
    styles = {(tuple(style(i)["color"]), style(i)["marker"]) for i in range(40)}
    assert len(styles) == 40
