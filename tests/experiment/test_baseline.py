"""The plain baseline decoded once (specdec/experiment/baseline.py): cached by what decides its tokens, reused by
later runs with its speed re-measured beside them, refused when it belongs to other settings."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.experiment.run import run

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def cfg(tmp, *extra):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=[
            "+experiment=ngram", "debug=true", f"output_dir={tmp}", "dataset.categories=[writing,qa]",
            "sampling.max_tokens=8", "baseline_remeasure_tokens=3", *extra])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_BASELINE_CACHE", str(d))
    return d


def test_decoded_once_then_reused_with_its_speed_remeasured(tmp_path, cache, caplog):
    first = run(cfg(tmp_path / "a", "proposer.num_speculative_tokens=2"))
    assert first.baseline["source"] == "decoded" and (tmp_path / "a" / "baseline.json").is_file()
    assert len(list(cache.glob("*.json"))) == 1
    caplog.set_level("INFO", logger="specdec.baseline")
    second = run(cfg(tmp_path / "b", "proposer.num_speculative_tokens=3"))  # another job of the sweep
    assert second.baseline["source"].startswith("cache:") and second.baseline["key"] == first.baseline["key"]
    assert second.baseline["remeasure_tokens"] == 3 and "not decoded again" in caplog.text
    assert not (tmp_path / "b" / "baseline.json").exists()  # nothing new was decoded
    assert second.greedy_mismatches == 0  # the cached tokens are the plain tokens (checked against them)
    for a, b in zip(first.requests, second.requests):
        assert a.baseline_num_generated_tokens == b.baseline_num_generated_tokens
        assert b.baseline_seconds > 0 and b.baseline_num_steps >= 1  # re-measured, short: theory's t1 still there
    assert second.speedup is not None and second.baseline_tokens_per_s > 0


def test_a_named_run_is_used_or_refused_naming_what_differs(tmp_path, cache):
    run(cfg(tmp_path / "a", "baseline=fresh"))
    named = run(cfg(tmp_path / "b", f"baseline={tmp_path / 'a'}"))
    assert named.baseline["source"] == str(tmp_path / "a" / "baseline.json") and named.greedy_mismatches == 0
    with pytest.raises(ValueError, match=r"other settings: \['sampling'\] differ"):
        run(cfg(tmp_path / "c", f"baseline={tmp_path / 'a'}", "sampling.max_tokens=6"))
    with pytest.raises(ValueError, match="no baseline.json there"):
        run(cfg(tmp_path / "d", f"baseline={tmp_path / 'nowhere'}"))


def test_a_cache_of_other_tokens_is_caught(tmp_path, cache):
    """A cache entry whose tokens are not this engine's plain tokens (other code wrote it) fails loudly."""
    run(cfg(tmp_path / "a"))
    (entry,) = cache.glob("*.json")
    data = json.loads(entry.read_text())
    for turns in data["questions"].values():
        turns[0]["token_ids"] = [t + 1 for t in turns[0]["token_ids"]]
    entry.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="differs from this engine's plain decoding"):
        run(cfg(tmp_path / "b"))
    assert run(cfg(tmp_path / "c", "baseline=fresh")).baseline["source"] == "decoded"
