"""experiments/bench/ab.py: the eagle3_ngram config is read from a revision's own experiment file."""

from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.bench.ab import experiment_spec

ROOT = Path(__file__).resolve().parents[2]


def test_experiment_spec_is_what_the_experiment_composes():
    spec = experiment_spec(ROOT, "eagle3_ngram")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = compose(config_name="config", overrides=["+experiment=eagle3_ngram"])
    assert spec["method"] == "eagle3" and spec["scorer"] == "tree"
    assert (spec["tree_depth"], spec["tree_topk"], spec["tree_budget"]) == (
        c.scorer.tree_depth, c.scorer.tree_topk, c.scorer.tree_budget)
    assert spec["num_speculative_tokens"] == c.proposer.num_speculative_tokens
    assert spec["options"] == dict(c.proposer.options)
    assert (spec["prompt_lookup_min"], spec["prompt_lookup_max"]) == (
        c.proposer.prompt_lookup_min, c.proposer.prompt_lookup_max)


def test_any_experiment_by_name_carries_its_head():
    """``exp:eagle`` reads conf/experiment/eagle.yaml: the EAGLE-2 tree, the shipped EAGLE-1 head and its draft
    vocabulary, as ``+experiment=eagle`` composes them."""
    spec = experiment_spec(ROOT, "eagle")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = compose(config_name="config", overrides=["+experiment=eagle"])
    assert spec["method"] == "eagle" and spec["model"] == c.proposer.model
    assert (spec["tree_depth"], spec["tree_topk"], spec["tree_budget"]) == (
        c.scorer.tree_depth, c.scorer.tree_topk, c.scorer.tree_budget)
    assert spec["options"] == dict(c.proposer.options) and spec["options"]["draft_vocab_size"] == 4096
