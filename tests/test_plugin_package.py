"""A third-party proposer package (experiments/examples/bigram_proposer), pip-installed into a temp dir,
runs through its entry point and through _target_, with its own Hydra config."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.experiment.run import run
from specdec.experiment.summary import read_summary

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "experiments" / "examples" / "bigram_proposer"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    src, target = tmp / "src", tmp / "site"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))  # builds write beside it
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    with pytest.MonkeyPatch.context() as mp:  # the module's tests share it; undone (and caches reset) after them
        mp.syspath_prepend(str(target))
        yield target
    for name in [m for m in sys.modules if m.startswith("specdec_bigram")]:
        del sys.modules[name]


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_entry_point_is_discovered(installed):
    from specdec.spec_decode.registry import known_proposers, resolve_proposer

    assert "bigram" in known_proposers()
    assert resolve_proposer("bigram").__module__ == "specdec_bigram"


def test_plugin_runs_by_entry_point_name(installed, tmp_path):
    summary = run(compose_cfg(["proposer=plugin", "proposer.method=bigram", "debug=true", f"output_dir={tmp_path}",
                               "dataset.categories=[coding]"]))
    assert summary.components["proposer"] == "specdec_bigram.BigramProposer"
    assert summary.config["proposer"]["num_speculative_tokens"] == 4
    assert read_summary(tmp_path / "summary.json").mean_acceptance_length >= 1.0
    assert summary.greedy_mismatches == 0  # lossless: same tokens as plain greedy decoding


def test_plugin_experiment_from_its_own_config_dir_by_target(installed, tmp_path):
    # what `python -m specdec.run -cd experiments/examples/bigram_proposer/conf +experiment=bigram` composes
    cfg = compose_cfg([f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]", "+experiment=bigram", "debug=true",
                       f"output_dir={tmp_path}", "dataset.categories=[qa]"])
    assert cfg.proposer._target_ == "specdec_bigram.BigramProposer"
    summary = run(cfg)
    assert summary.components["proposer"] == "specdec_bigram.BigramProposer" and summary.num_prompts == 1
