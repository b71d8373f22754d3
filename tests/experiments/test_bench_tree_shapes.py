"""experiments/bench/tree_shapes.py: its grids hold only shapes the tree can fill and the proposer accepts, and each
shape's overrides compose into that shape (no model is loaded)."""

import pytest

from experiments.bench.tree_shapes import ROOT, Shape, grid, valid


def test_valid_refuses_what_the_tree_or_the_proposer_cannot_do():
    assert valid(Shape(3, 3, 6, 3))  # the flagship
    assert not valid(Shape(2, 2, 8, 0))  # 2 + 1 x 4 = 6 head candidates at most
    assert valid(Shape(2, 2, 8, 2))  # ... and 2 more from the branch
    assert valid(Shape(3, 4, 10, 6))  # a branch may reach past the head's depth (the flagship's)
    assert not valid(Shape(4, 3, 4, 4))  # m < budget
    assert not valid(Shape(5, 3, 4, 0))  # depth 5 needs >= 5 nodes


@pytest.mark.parametrize("name", ["quick", "full"])
def test_grid_shapes_are_distinct_and_valid(name):
    shapes = grid(name)
    assert len(shapes) == len(set(shapes)) and all(valid(s) for s in shapes)
    assert Shape(3, 3, 6, 3) in shapes  # the flagship is always compared


def test_overrides_compose_into_the_shape_the_proposer_accepts():
    from hydra import compose, initialize_config_dir

    from proposers.eagle import check_ngram_branch
    from specdec.experiment.compose import parse_config, speculative_config, to_container
    from specdec.spec_decode.config import parse_speculative_config

    shapes = [Shape(3, 3, 6, 3), Shape(4, 3, 10, 0), Shape(4, 4, 12, 3, "suffix"), Shape(3, 4, 10, 6)]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for s in shapes:
            cfg = compose(config_name="config", overrides=s.overrides())
            raw = {k: v for k, v in to_container(cfg).items() if k not in ("hydra", "experiment")}
            spec = parse_speculative_config(speculative_config(parse_config(raw)))
            assert (spec.tree_depth, spec.tree_topk, spec.tree_budget, spec.num_speculative_tokens) == \
                (s.depth, s.topk, s.budget, s.depth)
            assert check_ngram_branch("test", spec) == s.m and spec.options.get("branch") == s.branch
