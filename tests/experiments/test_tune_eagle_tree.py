"""experiments/train/tune_eagle_tree.py on the tiny model: trace, grid replay, forward costs, the overhead run,
the CSV and confirm=N end to end in seconds, with a pass-through EAGLE-1 head (it re-drafts the target's last
prediction, so some drafts are accepted and some are not; a random head never is)."""

import csv
from pathlib import Path

import pytest
import torch

from experiments.train import common
from experiments.train import tune_eagle_tree as tune


def tune_run(*overrides: str) -> dict:
    """``python -m experiments.train.tune_eagle_tree <overrides>``, in process."""
    return tune.run(common.compose("tune_eagle_tree", list(overrides)))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    """tests/experiment/test_replay.py's pass-through head, with a draft vocabulary (token frequencies = id order)."""
    from safetensors.torch import save_file

    from specdec.engine.tiny import tiny_config
    from specdec.heads.eagle import random_head, write_eagle1

    head = random_head(tiny_config(), "eagle", 0)
    D = head.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, D:] = torch.eye(D)
        head.self_attn.o_proj.weight.zero_()
        head.mlp.down_proj.weight.zero_()
    path = write_eagle1(tmp_path_factory.mktemp("head"), head.cfg, head.state_dict(), dtype=torch.float32)
    save_file({"ids": torch.arange(head.cfg.vocab_size)}, str(Path(path) / "draft_vocab.safetensors"))
    return Path(path)


def test_grid_skips_shapes_a_dynamic_tree_cannot_fill():
    S = tune.Shape
    got = tune.grid([1, 2, 3], [2], [1, 2, 6, 7, 10, 11], [None])
    # topk 2: depth 1 has 2 candidates, depth 2 has 2 + 4, depth 3 has 2 + 2*4; budget >= depth
    assert got == [S(1, 2, 1, None), S(1, 2, 2, None), S(2, 2, 2, None), S(2, 2, 6, None), S(3, 2, 6, None),
                   S(3, 2, 7, None), S(3, 2, 10, None)]
    assert S(3, 3, 6, 0).overrides("eagle", "h")[-1] == "proposer.options.draft_vocab_size=null"
    assert tune.default_shape("eagle3").vocab is None


def test_smoke_tiny(head_dir, tmp_path):
    out = tmp_path / "tune"
    res = tune_run("model=tiny", f"head={head_dir}", "categories=[writing,roleplay,math]", "per_category=1",
                   "max_tokens=32", "depths=[2,3]", "topks=[2,3]", "budgets=[4,8]", "vocabs=[0,64]", "reps=3",
                   "overhead_prompts=2", "confirm=1", "threads=1", f"out={out}")
    default = res["default"]
    assert (default.depth, default.topk, default.budget) == (3, 3, 6)  # conf/experiment/eagle.yaml
    # 2 depths x 2 topks x 2 budgets x 2 vocabs, less (d2, k2, b8: 6 candidates) x 2 vocabs, + the default
    # (its vocab, 2048, is not in the grid)
    with open(out / "tune_eagle_tree.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(res["rows"]) == 2 * 2 * 2 * 2 - 2 + 1
    assert {"tau", "acc_d1", "acc_d3", "v", "c", "overhead", "predicted_speedup"} <= set(rows[0])
    preds = [float(r["predicted_speedup"]) for r in rows]
    assert preds == sorted(preds, reverse=True)
    for r in res["rows"]:
        assert 1.0 <= r["tau"] <= r["depth"] + 1 and r["steps"] > 0 and r["draft_ms"] > 0
        assert r["v"] == pytest.approx(res["t_ms"][r["budget"] + 1] / res["t_ms"][1])
        assert r["predicted_speedup"] == pytest.approx(r["tau"] / (r["v"] + r["c"] + r["overhead"]))
    assert any(r["tau"] > 1.2 for r in res["rows"]) and any(r["acc"][0] < 1 for r in res["rows"])
    # the default's replay is exact: its counts equal the live overhead run's on the shared questions
    assert res["problems"] == [] and res["overhead"] > 0 and res["live_default"]["tau"] > 1
    assert (out / "costs.json").is_file() and (out / "trace" / "trace" / "meta.json").is_file()
    (c,) = res["confirmed"]
    assert c["shape"] == tune.Shape(*(res["rows"][0][k] for k in ("depth", "topk", "budget", "vocab"))).name
    assert c["counts_equal"] and c["live_tau"] == c["replay_tau"] and c["speedup"] > 0
    assert (out / "confirm.csv").is_file()

    # trace= reuses the recording; a one-point grid is the default itself
    d = tune.default_shape("eagle")  # conf/experiment/eagle1.yaml + conf/proposer/eagle.yaml
    res2 = tune_run(f"trace={out / 'trace'}", f"head={head_dir}", f"depths={d.depth}", f"topks={d.topk}",
                    f"budgets={d.budget}", f"vocabs={d.vocab}", "reps=2", "overhead_prompts=0",
                    f"out={tmp_path / 'again'}")
    (r,) = res2["rows"]
    assert r["overhead"] == 0 and r["counts"] == next(x for x in res["rows"] if x["vocab"] == d.vocab)["counts"]
