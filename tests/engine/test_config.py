"""ModelConfig from HF config.json dicts: both transformers 4.x and 5.x RoPE spellings, and refusals."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec.engine.config import ModelConfig, rope_inv_freq

SMOL = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def test_v4_and_v5_rope_spellings_agree():
    v4 = ModelConfig.from_hf_config({**SMOL, "rope_theta": 100000.0, "rope_scaling": None})
    v5 = ModelConfig.from_hf_config({**SMOL, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert v4 == v5
    assert v4.head_dim == 64 and v4.rope_theta == 100000.0 and v4.rope_scaling is None
    assert v4.eos_token_ids == (2,)


def test_qwen2_has_qkv_bias_and_no_window_unless_used():
    c = ModelConfig.from_hf_config({**SMOL, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert c.attention_bias and not c.o_proj_bias and c.sliding_window is None


def test_llama3_inv_freq_matches_transformers():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    d = {**SMOL, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, "rope_parameters": rope}
    ours = rope_inv_freq(ModelConfig.from_hf_config(d))
    cfg = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    theirs, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs)
    assert not torch.allclose(ours, rope_inv_freq(ModelConfig.from_hf_config({**d, "rope_parameters": None})))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is not supported.*llama, qwen2, mistral"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 4}, "not a multiple"),
    ],
)
def test_unsupported_configs_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**SMOL, **change})
