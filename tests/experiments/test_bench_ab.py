"""experiments/bench/ab.py: an experiment's speculative_config is what the revision's own compose builds."""

from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.bench.ab import experiment_spec
from specdec.experiment.compose import parse_config, speculative_config

ROOT = Path(__file__).resolve().parents[2]


def composed(name: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return speculative_config(parse_config(compose(config_name="config", overrides=[f"+experiment={name}"])))


def test_experiment_spec_is_what_the_run_builds():
    """Composed in a process of its own at the revision's path, the spec equals what specdec.run builds here,
    tree shape, n-gram branch and head included."""
    spec = experiment_spec(ROOT, "eagle3_ngram")
    assert spec == composed("eagle3_ngram")
    assert "tree" in spec["scorer"] and spec["options"]["ngram_branch"]  # the tree and its n-gram branch


def test_any_experiment_by_name_and_plain_decoding():
    spec = experiment_spec(ROOT, "medusa")
    assert spec == composed("medusa") and spec["num_speculative_tokens"] >= 1
    assert experiment_spec(ROOT, "baseline") is None  # plain decoding: no speculative_config
