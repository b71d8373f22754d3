"""The Hydra entry point: every experiment composes, debug mode runs end to end, typos fail clearly."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.run import parse_config, run
from specdec.summary import read_summary

CONF = str(Path(__file__).resolve().parents[1] / "conf")
EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_in_debug_mode(experiment, tmp_path, capsys):
    cfg = compose_cfg([f"+experiment={experiment}", "debug=true", f"output_dir={tmp_path}",
                       "dataset.categories=[writing,summarization]"])
    summary = run(cfg)
    path = tmp_path / "summary.json"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(path)  # the path is printed last
    back = read_summary(path)
    assert back.num_prompts == summary.num_prompts == 2
    assert back.num_generated_tokens == summary.num_generated_tokens > 0
    assert set(back.per_category) == {"writing", "summarization"}
    assert back.tokens_per_s > 0 and back.mean_acceptance_length >= 1.0


def test_plain_run_has_tau_one_and_no_speedup(tmp_path):
    summary = run(compose_cfg(["debug=true", f"output_dir={tmp_path}", "dataset.categories=[qa]"]))
    assert summary.mean_acceptance_length == 1.0
    assert summary.acceptance_rate is None and summary.speedup is None and summary.greedy_mismatches is None
    assert summary.requests[0].category == "qa" and summary.requests[0].num_generated_tokens == 8


def test_config_typo_is_a_clear_error():
    with pytest.raises(ValueError, match="max_num_seq"):
        parse_config({"max_num_seq": 3})
    with pytest.raises(ValueError, match="temprature"):
        parse_config({"sampling": {"temprature": 0.5}})


def test_unknown_category_is_named():
    from specdec.data import load_spec_bench

    with pytest.raises(ValueError, match="'poetry'"):
        load_spec_bench(["poetry"])
    assert {p.category for p in load_spec_bench("mt_bench", per_category=2)} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
