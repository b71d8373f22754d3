"""A seeded random tiny llama and a matching byte-level tokenizer, built in-process (no files, no hub).

For unit tests: the same seed gives the same weights, and ``to_hf_model`` gives transformers' model with
the very same weights, the reference our logits are compared with. Weights are drawn with scale
1/sqrt(fan_in) (not HF's 0.02), so activations and logits are O(1) and a wrong op changes them visibly.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from specdec.engine.config import ModelConfig
from specdec.engine.llama import Llama

__all__ = ["tiny_config", "tiny_random_llama", "tiny_random_llama_hf", "tiny_random_weights", "tiny_tokenizer", "to_hf_model"]

# Byte-level tokenizer: ids 0..2 are specials (as in SmolLM2: bos = <|im_start|> = 1, eos = <|im_end|> = 2),
# ids 3..258 the 256 bytes; the model's vocab (512) leaves the rest unused, like a padded embedding.
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(**overrides: Any) -> ModelConfig:
    """The tiny llama's config; override fields for variants (e.g. ``model_type="qwen2",
    attention_bias=True, tie_word_embeddings=False``)."""
    base = ModelConfig(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,  # room for Spec-Bench prompts in debug runs
        bos_token_id=1,
        eos_token_id=2,
    )
    return msgspec.structs.replace(base, **overrides)


def tiny_random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights drawn from ``torch.Generator().manual_seed(seed)`` in a fixed order."""
    c = config
    g = torch.Generator().manual_seed(seed)
    q, kv, D, I = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, c.intermediate_size

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(D, generator=g)

    def bias(n: int) -> torch.Tensor:
        return 0.1 * torch.randn(n, generator=g)

    # std 0.2: with tied embeddings the logits are ~|h| * 0.2 = 1.6 std, a spread-out distribution, so
    # sampling tests on the tiny model are not degenerate (std 1 gave near one-hot outputs).
    sd = {"model.embed_tokens.weight": 0.2 * torch.randn(c.vocab_size, D, generator=g)}
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sd[p + "input_layernorm.weight"] = norm()
        for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            sd[a + name + ".weight"] = w(n, D)
            if c.attention_bias:
                sd[a + name + ".bias"] = bias(n)
        sd[a + "o_proj.weight"] = w(D, q)
        if c.o_proj_bias:
            sd[a + "o_proj.bias"] = bias(D)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = w(I, D)
        sd[p + "mlp.up_proj.weight"] = w(I, D)
        sd[p + "mlp.down_proj.weight"] = w(D, I)
    sd["model.norm.weight"] = norm()
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = w(c.vocab_size, D)
    return sd


def tiny_random_llama(
    seed: int = 0,
    *,
    num_slots: int = 8,
    max_model_len: int = 2048,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **overrides: Any,
):
    """A NativeEngine over the tiny random llama (config fields overridable)."""
    from specdec.engine.native import NativeEngine

    cfg = tiny_config(**overrides)
    model = Llama.from_hf_state_dict(cfg, tiny_random_weights(cfg, seed), dtype=dtype, device=device)
    return NativeEngine(model, num_slots=num_slots, max_model_len=max_model_len)


def to_hf_model(model_or_engine: Any, *, attn_implementation: str = "eager"):
    """transformers' ``*ForCausalLM`` (float32, eval mode) holding the very same weights as our model."""
    import transformers

    model: Llama = getattr(model_or_engine, "model", model_or_engine)
    hf_cfg = transformers.AutoConfig.for_model(**model.config.to_hf_config())
    hf_cfg._attn_implementation = attn_implementation
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = {k: v.detach().float().clone() for k, v in model.hf_state_dict().items()}
    if model.config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    return hf.eval()


def tiny_random_llama_hf(seed: int = 0, **overrides: Any):
    """transformers' model with exactly the weights of ``tiny_random_llama(seed, **overrides)``."""
    cfg = tiny_config(**overrides)
    return to_hf_model(Llama.from_hf_state_dict(cfg, tiny_random_weights(cfg, seed)))


def tiny_tokenizer():
    """A byte-level tokenizer (no merges: one token per UTF-8 byte) with SmolLM2-style chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(TINY_SPECIALS)}
    vocab.update({ch: len(TINY_SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )
