"""specdec/heads/common.py: the head directory reader/writer (and its refusals), key renaming, the llama
shape of a head's config.json, the one head loader (paths as given, under the repository, under
checkpoints/; the tiny-random fallback) and LMHeadRows (rows of the target's LM head)."""

from pathlib import Path

import pytest
import torch

from specdec.engine.tiny import tiny_config, tiny_random_llama
from specdec.heads import HeadConfig
from specdec.heads.common import (CHECKPOINTS, RANDOM_HEAD, REPO, LMHeadRows, hf_config, hf_shape, load_head_module,
                                  read_dir, resolve_head_path, take, write_dir)

HINT = "train one with python -m experiments.train.x"


# ---------------------------------------------------------------------------------------------- directories


def test_write_then_read_round_trips(tmp_path):
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5)}
    p = write_dir(tmp_path / "head", {"hidden_size": 4}, tensors)
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    cfg, sd = read_dir(p)
    assert cfg == {"hidden_size": 4} and sd.keys() == tensors.keys()
    assert all(torch.equal(sd[k], v) for k, v in tensors.items())


def test_a_pytorch_bin_is_read_too(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    assert torch.equal(read_dir(tmp_path)[1]["w"], torch.ones(2))


def test_broken_directories_say_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory; give a folder with config.json"):
        read_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has none of model.safetensors, pytorch_model.bin"):
        read_dir(tmp_path)


def test_take_renames_and_names_the_missing_keys():
    sd = {"fc.weight": torch.ones(1), "extra": torch.zeros(1)}
    assert list(take(sd, {"fc.weight": "proj.weight"}, "EAGLE", "/h")) == ["proj.weight"]
    with pytest.raises(KeyError, match=r"EAGLE head /h: missing \['norm.weight'\].*is this a EAGLE checkpoint"):
        take(sd, {"fc.weight": "proj.weight", "norm.weight": "norm.weight"}, "EAGLE", "/h")


def test_hf_config_and_hf_shape_round_trip():
    c = HeadConfig.for_target(tiny_config(), "eagle")
    d = hf_config(c, "LlamaForCausalLM", bias=True)
    assert d["architectures"] == ["LlamaForCausalLM"] and d["bias"] is True and d["num_hidden_layers"] == 1
    shape = hf_shape(d)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "rope_theta", "max_position_embeddings"):
        assert shape[key] == getattr(c, key), key
    # transformers 4.x configs may omit num_key_value_heads / head_dim: MHA, hidden_size // heads
    bare = {k: v for k, v in d.items() if k not in ("num_key_value_heads", "head_dim")}
    assert hf_shape(bare)["num_key_value_heads"] == c.num_attention_heads
    assert hf_shape(bare)["head_dim"] == c.hidden_size // c.num_attention_heads


# ---------------------------------------------------------------------------------------------- one loader


def test_resolve_head_path_as_given_or_under_the_repo_or_checkpoints(tmp_path, monkeypatch):
    assert resolve_head_path(tmp_path, "EagleProposer", HINT) == tmp_path  # exists as given
    monkeypatch.chdir(tmp_path)  # relative paths no longer exist as given
    rel = Path("checkpoints") / "smollm2-135m-instruct-eagle"
    assert resolve_head_path(rel, "EagleProposer", HINT) == REPO / rel  # relative to the repository
    name = next(p.name for p in CHECKPOINTS.iterdir() if p.is_dir())
    assert resolve_head_path(name, "EagleProposer", HINT) == CHECKPOINTS / name  # a bare checkpoint name


def test_a_missing_head_names_the_places_looked_and_the_ways_out():
    with pytest.raises(FileNotFoundError, match=rf"MedusaProposer: no head at 'no_such_head_xyz' .*under {CHECKPOINTS}"
                                                rf".*{HINT}, or give model={RANDOM_HEAD} for random heads"):
        resolve_head_path("no_such_head_xyz", "MedusaProposer", HINT)


def test_load_head_module_random_for_the_tiny_name_else_the_loader_on_the_resolved_path(tmp_path):
    calls = []
    assert load_head_module(RANDOM_HEAD, "X", lambda p: calls.append(p), lambda: "random", HINT) == "random"
    assert calls == []
    assert load_head_module(str(tmp_path), "X", lambda p: ("loaded", p), lambda: "random", HINT) == ("loaded", tmp_path)
    with pytest.raises(FileNotFoundError, match="X: no head at"):
        load_head_module(tmp_path / "missing", "X", lambda p: p, lambda: "random", HINT)


# ---------------------------------------------------------------------------------------------- LM head rows


def test_lm_head_rows_are_the_targets_logits_for_those_ids():
    target = tiny_random_llama(0, num_slots=1, max_model_len=16)
    h = torch.randn(5, target.hidden_size, generator=torch.Generator().manual_seed(0))
    full = target.compute_logits(h).float()  # [5, V]
    every = LMHeadRows(target, None)
    assert every.size == target.vocab_size
    torch.testing.assert_close(every.logits(h), full, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([3, 17, 400, 2])
    some = LMHeadRows(target, ids)
    assert some.size == 4 and some.weight.shape == (4, target.hidden_size)
    torch.testing.assert_close(some.logits(h), full[:, ids], atol=1e-4, rtol=1e-4)
