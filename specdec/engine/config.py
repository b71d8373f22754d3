"""`ModelConfig`: the llama-family hyper-parameters the native engine needs, read from an HF config.json.

Covers Llama (incl. SmolLM), Qwen2 and Mistral checkpoints. Anything the engine would silently get
wrong (an unknown architecture, a RoPE scaling we do not implement, an MLP bias, a non-SiLU activation)
is refused here with an error that says what was found. This module knows nothing about weights.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_type: str  # "llama" | "qwen2" | "mistral": picks the transformers class for references
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # I: SwiGLU width
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA when < num_attention_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear"|"llama3", "factor": ..., ...} as HF writes it
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False  # LM head reuses the embedding matrix
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias)
    o_proj_bias: bool = False  # bias on the output projection (only Llama with attention_bias)
    max_position_embeddings: int = 2048
    # Mistral / Qwen2 sliding-window attention. The engine does not implement it; it refuses a
    # max_model_len above the window, where full attention would differ from the trained model.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """eos_token_id as a tuple (HF allows an int or a list)."""
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"ModelConfig: model_type={mt!r} is not supported by the native engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use a transformers-backed engine"
            )
        missing = [k for k in REQUIRED_HF_FIELDS if k not in d]
        if missing:
            raise ValueError(f"ModelConfig: config.json lacks {', '.join(missing)}; a {mt} config needs "
                             f"{', '.join(REQUIRED_HF_FIELDS)} (write them, or re-export the model with transformers)")
        bad = {k: d[k] for k in REQUIRED_HF_FIELDS if isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 1}
        if bad:
            raise ValueError(f"ModelConfig: config.json has {bad}; each must be an int >= 1")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"ModelConfig: hidden_act={act!r}; the native engine implements only SwiGLU ('silu')")
        if d.get("mlp_bias", False):
            raise ValueError("ModelConfig: mlp_bias=True is not supported by the native engine")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        theta, scaling = _rope_from_hf(d)
        llama_bias = bool(d.get("attention_bias", False)) if mt == "llama" else False
        window = d.get("sliding_window")
        if mt == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # llama/qwen2/mistral config classes all default to untied embeddings
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else llama_bias,
            o_proj_bias=llama_bias,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            sliding_window=window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers' Llama/Qwen2/Mistral config classes accept."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        d: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
        }
        if self.model_type == "llama":
            if self.attention_bias != self.o_proj_bias:
                raise ValueError("to_hf_config: transformers' Llama has q/k/v and o biases together or not at all")
            d["attention_bias"] = self.attention_bias
        elif self.attention_bias != (self.model_type == "qwen2") or self.o_proj_bias:
            raise ValueError(f"to_hf_config: {self.model_type} cannot express attention_bias={self.attention_bias}")
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
        elif self.model_type == "mistral":
            d["sliding_window"] = None
        return d


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("ModelConfig: partial_rotary_factor != 1 is not supported by the native engine")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"ModelConfig: rope_type={rope_type!r} is not supported by the native engine "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); use a transformers-backed engine"
        )
    if rope_type == "default":
        return theta, None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(params["factor"])}
    if rope_type == "llama3":
        scaling["low_freq_factor"] = float(params["low_freq_factor"])
        scaling["high_freq_factor"] = float(params["high_freq_factor"])
        scaling["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or d.get("max_position_embeddings", 8192)
        )
    return theta, scaling


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, as transformers computes them (default/linear/llama3)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend in between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)
