"""specdec.experiment.data.load_distill_heldout: the distillation pools' held-out prompts (tau in distribution)."""

from __future__ import annotations

import gzip
import json

import pytest

from specdec.experiment.data import MT_BENCH_CATEGORIES, load_distill_heldout


def _pool(tmp_path, rows):
    with gzip.open(tmp_path / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(tmp_path)


def _row(i, cat, text=None, messages=None):
    return {"id": i, "category": cat, "messages": messages or [{"role": "user", "content": text or f"q{i}"}]}


def test_only_held_out_single_user_turns_in_pool_order(tmp_path):
    two_turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}]
    path = _pool(tmp_path, [_row(40, "math"), _row(1, "math"), _row(20, "math", messages=two_turns),
                            _row(0, "math"), _row(60, "math"), _row(80, "writing")])
    got = load_distill_heldout(path, categories=["math"], per_category=2)
    assert [(p.question_id, p.category, p.turns) for p in got] == [("40", "math", ["q40"]), ("0", "math", ["q0"])]
    assert [p.question_id for p in load_distill_heldout(path, "all", None)] == ["40", "0", "60", "80"]
    assert [p.question_id for p in load_distill_heldout(path, "all", None, every=40)] == ["40", "0", "80"]


def test_mt_bench_keeps_the_pools_mt_bench_categories(tmp_path):
    path = _pool(tmp_path, [_row(0, "translation"), _row(20, "coding"), _row(40, "writing")])
    assert [p.category for p in load_distill_heldout(path)] == ["coding", "writing"]


@pytest.mark.parametrize("kwargs, msg", [
    ({"categories": ["poetry"]}, r"\['poetry'\] are not in .*has \['math'\]"),
    ({"categories": ["math"], "every": 0}, r"every=0 must be a positive int"),
    ({"categories": ["math"], "every": 7}, r"no held-out prompts selected .*every=7"),
])
def test_bad_selections_name_the_value(tmp_path, kwargs, msg):
    path = _pool(tmp_path, [_row(20, "math"), _row(40, "math")])
    with pytest.raises(ValueError, match=msg):
        load_distill_heldout(path, **kwargs)


def test_a_missing_pool_names_the_way_out(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"set dataset\.path to a folder holding prompts\.jsonl\.gz"):
        load_distill_heldout(str(tmp_path / "nowhere"))


def test_the_committed_pools_from_any_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a relative path falls back to the repository
    pool = load_distill_heldout()
    assert {p.category for p in pool} == set(MT_BENCH_CATEGORIES) and len(pool) == 16
    assert all(int(p.question_id) % 20 == 0 for p in pool)
    magpie = load_distill_heldout("data/distill/magpie", "all", 16)
    assert len(magpie) == 16 and {p.category for p in magpie} == {"magpie"}
