"""specdec/heads/config.py: eagle3_layers (the published choice of fused layers) and HeadConfig (a head
shaped like one target layer, per method; its refusals; feature width; the RoPE config it hands the
attention)."""

import pytest

from specdec.engine.tiny import tiny_config
from specdec.heads.config import HeadConfig, eagle3_layers


def test_default_layers_match_the_published_choice():
    assert eagle3_layers(30) == (1, 14, 26)  # SmolLM2: the inputs of layers 2, 15, 27 = outputs of 1, 14, 26
    assert eagle3_layers(32) == (1, 15, 28)  # Llama-3-8B: inputs of 2, 16, 29 as the EAGLE-3 code takes


def test_for_target_is_one_target_layer_per_method():
    c = tiny_config()
    e1 = HeadConfig.for_target(c, "eagle")
    assert (e1.hidden_size, e1.num_attention_heads, e1.num_key_value_heads, e1.head_dim, e1.vocab_size) == (
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    assert e1.fc_bias and e1.hidden_layers == () and e1.feature_size == c.hidden_size  # EAGLE-1 reads one layer
    e3 = HeadConfig.for_target(c, "eagle3", draft_vocab_size=96)
    assert not e3.fc_bias and e3.hidden_layers == eagle3_layers(c.num_hidden_layers) and e3.draft_vocab_size == 96
    assert e3.feature_size == 3 * c.hidden_size  # three fused target layers
    assert HeadConfig.for_target(c, "eagle3", target_hidden_size=32).feature_size == 96


def test_rope_config_carries_the_heads_rope():
    c = tiny_config()
    rc = HeadConfig.for_target(c, "eagle").rope_config()
    assert (rc.rope_theta, rc.rope_scaling, rc.head_dim, rc.num_hidden_layers) == (c.rope_theta, c.rope_scaling,
                                                                                   c.head_dim, 1)


@pytest.mark.parametrize("method, over, match", [
    ("medusa", {}, "method='medusa'; expected 'eagle' or 'eagle3'"),
    ("eagle", {"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_bad_configs_are_refused_naming_the_field(method, over, match):
    with pytest.raises(ValueError, match=match):
        HeadConfig.for_target(tiny_config(), method, **over)
