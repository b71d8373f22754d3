"""Loaders refuse a config.json that disagrees with its weights, naming both values (issue #16):
vocabulary, hidden size, layer count, head counts and tied embeddings; a config.json with missing fields
names them; an empty .gguf names its path. Tiny checkpoints are written on the fly (no hub)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from specdec.engine.loader import load_engine, model_info
from specdec.engine.tiny import tiny_config, tiny_random_weights


def write_model(path, *, tied: bool = True, drop: tuple[str, ...] = (), weights=None, **config_overrides):
    """config.json of the tiny llama with ``config_overrides`` beside the tiny llama's own weights."""
    cfg = tiny_config(tie_word_embeddings=tied)
    sd = weights if weights is not None else tiny_random_weights(cfg, 0)
    d = {**cfg.to_hf_config(), **config_overrides}
    for k in drop:
        d.pop(k)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


def test_matching_config_and_weights_load(tmp_path):
    engine = load_engine(str(write_model(tmp_path / "m")), max_model_len=32)
    assert engine.config == tiny_config()


@pytest.mark.parametrize("field, value, weights_say", [
    ("vocab_size", 300, "vocab_size=512"),
    ("hidden_size", 32, "hidden_size=64"),
    ("num_hidden_layers", 2, "4 layers"),
    ("num_hidden_layers", 6, "4 layers"),
    ("num_attention_heads", 8, "4 heads of head_dim=16"),
    ("num_key_value_heads", 4, "2 heads of head_dim=16"),
])
def test_a_config_that_disagrees_with_the_weights_names_both(tmp_path, field, value, weights_say):
    path = write_model(tmp_path / "m", **{field: value})
    with pytest.raises(ValueError, match=rf"config.json says {field}={value} but the weights have {weights_say}"):
        load_engine(str(path), max_model_len=32)


def test_tied_embeddings_mismatch_is_named_both_ways(tmp_path):
    untied = tiny_random_weights(tiny_config(tie_word_embeddings=False), 0)  # has its own lm_head.weight
    path = write_model(tmp_path / "a", tied=True, weights=untied)
    with pytest.raises(ValueError, match="tie_word_embeddings=true but the weights have their own lm_head.weight"):
        load_engine(str(path), max_model_len=32)
    tied = tiny_random_weights(tiny_config(), 0)
    assert "lm_head.weight" not in tied
    path = write_model(tmp_path / "b", tied=False, weights=tied)
    with pytest.raises(ValueError, match="tie_word_embeddings=false but the weights have no lm_head.weight"):
        load_engine(str(path), max_model_len=32)


def test_an_lm_head_equal_to_the_embedding_is_fine_when_tied(tmp_path):
    sd = tiny_random_weights(tiny_config(), 0)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # some exporters save both
    load_engine(str(write_model(tmp_path / "m", weights=sd)), max_model_len=32)


@pytest.mark.parametrize("missing", [("hidden_size",), ("vocab_size", "num_hidden_layers")])
def test_missing_config_fields_are_named(tmp_path, missing):
    path = write_model(tmp_path / "m", drop=missing)
    with pytest.raises(ValueError, match=f"config.json: ModelConfig: config.json lacks {', '.join(missing)}"):
        model_info(str(path))


def test_a_config_field_of_the_wrong_type_is_named(tmp_path):
    path = write_model(tmp_path / "m", hidden_size="64")
    with pytest.raises(ValueError, match=r"\{'hidden_size': '64'\}; each must be an int >= 1"):
        load_engine(str(path), max_model_len=32)


def test_malformed_config_json_names_the_file(tmp_path):
    path = write_model(tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"m/config.json: not valid JSON"):
        load_engine(str(path), max_model_len=32)


def test_an_empty_gguf_names_its_path(tmp_path):
    empty = tmp_path / "model.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"GGUF file '{empty}' is empty \(0 bytes\)"):
        load_engine(str(empty))


def test_a_truncated_safetensors_names_the_file(tmp_path):
    path = write_model(tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        load_engine(str(path), max_model_len=32)
