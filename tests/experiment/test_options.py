"""Proposer options reach ``__init__`` from the command line (no ``+``), a sweep over one changes what the proposer
does (measured by replay), and a replay that names no proposer replays the traced run's own."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.experiment.compose import open_options
from specdec.experiment.replay import inherit_drafter, replay
from specdec.experiment.run import run
from specdec.experiment.summary import read_summary

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
PLUGIN = ["proposer=plugin", "proposer._target_=tests.spec_decode.my_proposer.EchoProposer",
          "proposer.num_speculative_tokens=3"]
BASE = ["model=tiny", "turns=1", "measure_baseline=false", "warmup=false", "sampling.max_tokens=48",
        "dataset.categories=[writing,qa,math_reasoning]"]


def cfg(name, overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_option_overrides_become_add_or_set():
    assert open_options(["proposer.options.nmax=1", "-m", "proposer.options.a=1,2", "++proposer.options.b=2",
                         "proposer.num_speculative_tokens=2"]) == [
        "++proposer.options.nmax=1", "-m", "++proposer.options.a=1,2", "++proposer.options.b=2",
        "proposer.num_speculative_tokens=2"]


@pytest.fixture(scope="module")
def plain_trace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plain")
    run(cfg("config", BASE + ["trace=true", f"output_dir={d}"]))
    return d


def _replay_cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "specdec.replay", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_a_sweep_over_an_option_reaches_init_and_changes_the_result(plain_trace, tmp_path):
    sweep = tmp_path / "sweep"
    done = _replay_cli([str(plain_trace), "-m", "hydra/launcher=basic", *PLUGIN,
                        "proposer.options.repeat_last=true,false", f"hydra.sweep.dir={sweep}"], ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {s.config["proposer"]["options"]["repeat_last"]: s
            for s in map(read_summary, sorted(sweep.rglob("summary.json")))}
    assert set(runs) == {True, False}
    # repeat_last drafts [t, t, t]; the default drafts the last 3 tokens: different drafts, different acceptance
    counts = {k: [c for r in s.requests for c in r.acceptance_counts] for k, s in runs.items()}
    assert counts[True] != counts[False]


def test_an_unknown_option_is_refused_naming_the_ones_it_takes(plain_trace, tmp_path):
    done = _replay_cli([str(plain_trace), *PLUGIN, "proposer.options.nmax=1", f"hydra.run.dir={tmp_path}"], ROOT)
    assert done.returncode != 0 and "nmax" in done.stderr and "repeat_last" in done.stderr, done.stderr[-2000:]


def test_replay_defaults_to_the_traced_runs_drafter(tmp_path):
    live = run(cfg("config", BASE + ["proposer=ngram", "proposer.num_speculative_tokens=4",
                                     "trace=true", f"output_dir={tmp_path / 'live'}"]))
    same = replay(cfg("replay", [f"run_dir={tmp_path / 'live'}", f"output_dir={tmp_path / 'a'}"]))
    assert same.config["proposer"]["num_speculative_tokens"] == 4
    assert same.mean_acceptance_length == pytest.approx(live.mean_acceptance_length)  # greedy replay is exact
    two = replay(cfg("replay", [f"run_dir={tmp_path / 'live'}", "proposer.num_speculative_tokens=2",
                                f"output_dir={tmp_path / 'b'}"]))
    assert two.config["proposer"]["num_speculative_tokens"] == 2
    assert two.config["proposer"]["_target_"] == "proposers.ngram.NGramProposer"
    assert two.config["proposer"]["prompt_lookup_max"] == live.config["proposer"]["prompt_lookup_max"]


def test_inherit_keeps_what_the_command_line_chose():
    traced = {"proposer": {"_target_": "proposers.ngram.NGramProposer", "num_speculative_tokens": 10,
                           "prompt_lookup_max": 3}, "scorer": {"_target_": "scorers.tree.TreeScorer", "tree_topk": 2}}
    raw = {"proposer": {"_target_": None, "method": "none", "num_speculative_tokens": 2},
           "scorer": {"_target_": "scorers.mqa.MQAScorer"}}
    got = inherit_drafter(raw, traced, ["proposer.num_speculative_tokens=2", "run_dir=x"])
    assert got["proposer"] == {**traced["proposer"], "num_speculative_tokens": 2}
    assert got["scorer"] == traced["scorer"]  # not on the command line: the traced run's
    got = inherit_drafter(raw, traced, ["scorer=mqa"])
    assert got["scorer"] == raw["scorer"] and got["proposer"] == traced["proposer"]
    named = {**raw, "proposer": {"_target_": "proposers.ngram.NGramProposer", "num_speculative_tokens": 2}}
    assert inherit_drafter(named, traced, []) is named  # a proposer named: nothing inherited
    assert inherit_drafter(raw, {"proposer": {"method": "none"}}, []) is raw  # a plain trace: nothing to inherit
