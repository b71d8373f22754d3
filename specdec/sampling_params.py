"""Per-request sampling parameters (vLLM-like). Knows nothing about models or tensors."""

from __future__ import annotations

import math

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    """How one request samples. ``temperature == 0`` means greedy."""

    n: int = 1  # completions per prompt; only 1 is supported
    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1  # keep the k most likely tokens; -1 (or 0) = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; in [0, 1]
    seed: int | None = None  # per-request generator: reproducible whatever else is in the batch
    max_tokens: int = 16  # new tokens to generate, >= 1
    stop_token_ids: list[int] = msgspec.field(default_factory=list)  # extra stop ids (emitted, then stop)
    ignore_eos: bool = False  # keep going past the tokenizer's EOS
    logprobs: int | None = None  # return this many top logprobs per emitted token (+ the chosen one)

    def __post_init__(self) -> None:
        def bad(field: str, value, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={value!r} is invalid: {allowed}.")

        if self.n != 1:
            raise bad("n", self.n, "only n=1 is supported; submit the prompt several times instead")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise bad("temperature", self.temperature, "must be a finite float >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "must be -1 (off), 0 (off) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", self.logprobs, "must be None or an integer >= 0")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "must be None or an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)
