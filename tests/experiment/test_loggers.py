"""W&B logging: an offline run holds the logged keys under the run dir; a W&B failure never stops a run."""

from pathlib import Path

import msgspec
import pytest
from hydra import compose, initialize_config_dir

from specdec.experiment.run import run
from specdec.experiment.summary import read_summary

CONF = str(Path(__file__).resolve().parents[2] / "conf")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Every W&B path (cache, staging, settings) under tmp; restored after the test."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def debug_cfg(out: Path, *extra: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=[
            "+experiment=ngram", "debug=true", "logger=wandb", f"output_dir={out}", "dataset.categories=[qa,coding]",
            *extra])


def test_offline_run_is_written_under_the_run_dir_with_the_logged_keys(wandb_env):
    out = wandb_env / "run"
    summary = run(debug_cfg(out, "logger.group=g-test", "proposer.speculation_policy=goodput"))
    import wandb

    wandb.teardown()  # finish() returns before W&B's writer has flushed the run file; teardown waits for it
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    for key in (b"question/mean_acceptance_length", b"question/acceptance_rate", b"question/tokens_per_s",
                b"acceptance_per_position", b"per_category", b"mean_acceptance_length", b"speedup",
                b"summary-", b"g-test", b"proposers.ngram.NGramProposer",
                b"predicted_tau", b"verify_cost", b"draft_cost", b"predicted_speedup", b"efficiency",
                b"mean_chosen_k", b"speculation_policy", b"cost_table_ms/1"):
        assert key in data, key  # history keys, charts, artifact, group and config live in the run's records
    tables = [p.name for p in (run_dir / "files" / "media").rglob("*.table.json")]
    charts = ("acceptance_per_position", "alpha_per_position", "per_category", "chosen_k")
    assert set(charts) == {n for n in charts if any(t.startswith(n) for t in tables)}
    import json

    (per_cat,) = [p for p in (run_dir / "files" / "media").rglob("per_category*.table.json")]
    table = json.loads(per_cat.read_text())
    for f in ("predicted_tau", "verify_cost", "draft_cost", "predicted_speedup", "efficiency"):
        col = table["columns"].index(f)
        assert all(isinstance(row[col], float) for row in table["data"]), (f, table["data"])  # every category
    assert read_summary(out / "summary.json").num_prompts == summary.num_prompts == 2


def test_wandb_init_failure_is_a_warning_and_the_run_goes_on(wandb_env, monkeypatch, capsys):
    import wandb

    def down(*a, **k):
        raise ConnectionError("simulated W&B outage")

    monkeypatch.setattr(wandb, "init", down)
    out = wandb_env / "run"
    with pytest.warns(RuntimeWarning, match="W&B init failed.*simulated W&B outage"):
        run(debug_cfg(out))
    assert read_summary(out / "summary.json").num_prompts == 2
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out / "summary.json")


def test_wandb_failure_mid_run_is_a_warning_and_the_run_goes_on(wandb_env, monkeypatch):
    import wandb

    class FlakyRun:  # init works, then the connection drops: every log raises
        name, id, finished = "flaky", "x1", False

        def log(self, *a, **k):
            raise ConnectionError("simulated W&B outage")

        def finish(self):
            FlakyRun.finished = True

    monkeypatch.setattr(wandb, "init", lambda **k: FlakyRun())
    out = wandb_env / "run"
    with pytest.warns(RuntimeWarning, match="W&B log failed.*simulated W&B outage"):
        run(debug_cfg(out))
    assert (out / "summary.json").exists() and FlakyRun.finished  # the run is still closed


def test_bad_mode_is_a_config_error():
    from specdec.experiment.loggers import WandbLogger

    with pytest.raises(ValueError, match="logger.mode='onlin'"):
        WandbLogger(mode="onlin")


def test_a_questions_speedup_is_a_ratio_of_tokens_per_s_when_the_counts_differ():
    """Sampled runs emit different token counts: 12 tokens in 1 s against the baseline's 41 in 3 s is 12 / 13.67 =
    0.878x, where the ratio of times said 3.0x (the log and W&B printed it)."""
    from specdec.experiment.loggers import question_figures
    from specdec.experiment.summary import RequestRecord

    rec = RequestRecord(question_id="q", category="qa", num_prompt_tokens=5, num_generated_tokens=12, seconds=1.0,
                        baseline_seconds=3.0, baseline_num_generated_tokens=41, finish_reason="stop", text="",
                        greedy_match=None)
    assert question_figures(rec)["speedup"] == pytest.approx(12 / (41 / 3.0))
    same = msgspec.structs.replace(rec, baseline_num_generated_tokens=None)  # greedy: the same tokens
    assert question_figures(same)["speedup"] == pytest.approx(3.0)


@pytest.mark.parametrize("tags, want", [("fast", ["fast"]), (["a", "b"], ["a", "b"]), (None, [])])
def test_wandb_tags_take_one_string_as_one_tag(tags, want):
    from specdec.experiment.loggers import WandbLogger

    assert WandbLogger(tags=tags, mode="disabled").tags == want


@pytest.mark.parametrize("tags", [5, ["a", 5]])
def test_wandb_tags_that_are_not_strings_are_refused_by_name(tags):
    from specdec.experiment.loggers import WandbLogger

    with pytest.raises(ValueError, match=r"logger.tags=.* must be a string or a list of strings"):
        WandbLogger(tags=tags, mode="disabled")
