"""`HeadConfig`: the shape of an EAGLE-1 or EAGLE-3 draft head, and which target layers EAGLE-3 fuses.

Knows nothing about weights, modules or file formats (those are ``eagle.py`` and ``eagle3.py`` here).
"""

from __future__ import annotations

from typing import Any

import msgspec

from specdec.engine.config import ModelConfig


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose *outputs* EAGLE-3 fuses: (1, L//2 - 1, L - 4). These are the residual
    streams entering layers 2, L//2 and L-3, which is what the published EAGLE-3 code and vLLM collect."""
    return (1, num_layers // 2 - 1, num_layers - 4)


class HeadConfig(msgspec.Struct, kw_only=True, frozen=True):
    """A head's shape. Written to config.json next to the weights (plus EAGLE's own key names)."""

    method: str  # "eagle" | "eagle3"
    hidden_size: int  # D of the head (= the target's for every head here)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    fc_bias: bool = True  # EAGLE-1's fc has a bias, EAGLE-3's has none
    target_hidden_size: int | None = None  # EAGLE-3: width of each fused target layer (None = hidden_size)
    draft_vocab_size: int | None = None  # EAGLE-3: rows of lm_head (None = vocab_size)
    hidden_layers: tuple[int, ...] = ()  # EAGLE-3: target layers fused (outputs); () = eagle3_layers(L)

    def __post_init__(self) -> None:
        if self.method not in ("eagle", "eagle3"):
            raise ValueError(f"HeadConfig: method={self.method!r}; expected 'eagle' or 'eagle3'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"HeadConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def feature_size(self) -> int:
        """Width of the target features the head takes: D (EAGLE-1) or 3 x target_hidden_size (EAGLE-3)."""
        if self.method == "eagle":
            return self.hidden_size
        return 3 * (self.target_hidden_size or self.hidden_size)

    def rope_config(self) -> ModelConfig:
        return ModelConfig(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings)

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, method: str, **overrides: Any) -> "HeadConfig":
        """A head shaped like one layer of the target (what EAGLE trains)."""
        c = target_cfg
        base = dict(method=method, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                    intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                    rope_scaling=c.rope_scaling, vocab_size=c.vocab_size,
                    max_position_embeddings=c.max_position_embeddings, fc_bias=method == "eagle")
        if method == "eagle3":
            base["hidden_layers"] = eagle3_layers(c.num_hidden_layers)
        base.update(overrides)
        return cls(**base)
