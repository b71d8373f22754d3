"""Per-request sampling parameters (vLLM-like). Knows nothing about models or tensors.

Every field is typed with its range (``Annotated[..., Meta(...)]``) and checked by msgspec on
construction, so ``max_tokens=1.5``, ``seed=1.5`` or ``stop_token_ids=[-1]`` are refused instead of
coerced: TypeError for the wrong kind of value, ValueError for one out of range.

Two kinds of fields:
- fields that do not change the token distribution: ``n`` (parallel samples, each child seeded
  ``seed + i``), ``stop`` strings, ``skip_special_tokens``, ``prompt_logprobs``, ``logprob_token_ids``;
- logits processors (``min_tokens``, penalties, ``logit_bias``, ``allowed_token_ids``, ``bad_words``),
  applied by :mod:`specdec.sampling.logits_process` to the target's logits, conditioned on each position's prefix.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated

import msgspec
from msgspec import Meta


def _m(description: str, **bounds) -> Meta:
    return Meta(description=description, **bounds)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, dict=True):
    """How one request samples. ``temperature == 0`` means greedy.

    ``dict=True`` lets the engine attach private attributes (``_eos_token_id`` for min_tokens) that are
    never serialised."""

    # completions per prompt: n child requests, child i seeded seed + i (unseeded when seed is None)
    n: Annotated[int, _m("an int in [1, 128]", ge=1, le=128)] = 1
    # 0 = greedy (argmax); > 0 divides the logits
    temperature: Annotated[float, _m("a finite float >= 0 (0 = greedy)", ge=0)] = 1.0
    # nucleus mass; 1 = off
    top_p: Annotated[float, _m("a float in (0, 1] (1 = off)", gt=0, le=1)] = 1.0
    # keep the k most likely tokens; -1 (or 0) = off
    top_k: Annotated[int, _m("-1 (off), 0 (off) or a positive int", ge=-1)] = -1
    # drop tokens with prob < min_p * max prob
    min_p: Annotated[float, _m("a float in [0, 1] (0 = off)", ge=0, le=1)] = 0.0
    # per-request generator: reproducible whatever else is in the batch
    seed: Annotated[int, _m("None or an int in [0, 2**63)", ge=0, le=2**63 - 1)] | None = None
    # new tokens to generate
    max_tokens: Annotated[int, _m("an int >= 1", ge=1)] = 16
    # extra stop ids (emitted, then stop)
    stop_token_ids: list[Annotated[int, _m("token ids >= 0", ge=0)]] = msgspec.field(default_factory=list)
    ignore_eos: bool = False  # keep going past the tokenizer's EOS
    # return this many top logprobs per emitted token (+ the chosen one)
    logprobs: Annotated[int, _m("None or an int >= 0", ge=0)] | None = None
    # -- do not change the distribution
    # stop strings: the output ends before the first one that appears (emitted text only)
    stop: list[Annotated[str, _m("non-empty strings", min_length=1)]] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    skip_special_tokens: bool = True  # drop special tokens from the output text
    # return this many top logprobs for every prompt token (+ the prompt token itself); the first is None
    prompt_logprobs: Annotated[int, _m("None or an int >= 0", ge=0)] | None = None
    # also return the logprobs of these token ids at every emitted position (beside the top-n `logprobs`)
    logprob_token_ids: list[Annotated[int, _m("token ids >= 0", ge=0)]] | None = None
    # -- logits processors (specdec/logits_process.py); off at their defaults
    # EOS and stop_token_ids cannot be sampled before this many output tokens
    min_tokens: Annotated[int, _m("an int >= 0 (and <= max_tokens)", ge=0)] = 0
    # subtract once per token id present in the output so far (OpenAI's presence_penalty)
    presence_penalty: Annotated[float, _m("a float in [-2, 2] (0 = off)", ge=-2, le=2)] = 0.0
    # subtract per occurrence in the output so far (OpenAI's frequency_penalty)
    frequency_penalty: Annotated[float, _m("a float in [-2, 2] (0 = off)", ge=-2, le=2)] = 0.0
    # divide positive / multiply negative logits of every token in prompt + output (CTRL's; 1 = off)
    repetition_penalty: Annotated[float, _m("a float in (0, 2] (1 = off)", gt=0, le=2)] = 1.0
    # token id -> value added to its logit (OpenAI's logit_bias, [-100, 100])
    logit_bias: Annotated[dict[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=-100, le=100)]],
                          _m("None or {token id >= 0: bias in [-100, 100]}")] | None = None
    # only these token ids may be sampled
    allowed_token_ids: list[Annotated[int, _m("token ids >= 0", ge=0)]] | None = None
    # words that must not be generated (tokenized by the engine into bad_words_token_ids)
    bad_words: list[Annotated[str, _m("non-empty strings", min_length=1)]] | None = None
    # the token sequences of bad_words (filled by the engine from its tokenizer; may be given directly):
    # a sequence's last token is masked wherever the output so far ends with the rest of it
    bad_words_token_ids: list[list[Annotated[int, _m("token ids >= 0", ge=0)]]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a bare str is one stop string, as in OpenAI's API
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict) and any(isinstance(k, str) for k in self.logit_bias):
            # JSON object keys are strings ({"50256": -100}): a key of digits is that token id
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        for name, hint in _field_types().items():
            value = getattr(self, name)
            try:
                checked = msgspec.convert(value, hint)
            except msgspec.ValidationError as e:
                raise _field_error(name, value, hint, e) from None
            if isinstance(checked, float) and not math.isfinite(checked):
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {_describe(hint)}")
            if checked is not value:
                setattr(self, name, checked)  # e.g. temperature=0 -> 0.0, a tuple of stop ids -> a list
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} is invalid: must be <= max_tokens="
                             f"{self.max_tokens}; raise max_tokens or lower min_tokens")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("SamplingParams.allowed_token_ids=[] is invalid: it would allow no token; pass at "
                             "least one id, or None for all")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """Whether outputs carry a logprob dict per emitted token (``logprobs`` or ``logprob_token_ids`` set)."""
        return self.logprobs is not None or bool(self.logprob_token_ids)

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)


_TYPES: dict[str, object] = {}


def _field_types() -> dict[str, object]:
    if not _TYPES:
        _TYPES.update(typing.get_type_hints(SamplingParams, include_extras=True))
    return _TYPES


def _describe(hint) -> str:
    """The ``Meta.description`` inside a field's type (through ``| None`` and ``list[...]``)."""
    todo = [hint]
    while todo:
        t = todo.pop(0)
        for meta in getattr(t, "__metadata__", ()):
            if isinstance(meta, Meta) and meta.description:
                return meta.description
        todo.extend(typing.get_args(t))
    return "True or False" if hint is bool else str(hint)


def _field_error(name: str, value, hint, e: msgspec.ValidationError) -> Exception:
    # msgspec words a type mismatch "Expected `int`, got `float`" and a range miss "Expected `int` >= 1"
    wrong_type = ", got `" in str(e)
    where = str(e).partition(" - at `$")[2].rstrip("`")
    at = f" (element {where})" if where else ""
    msg = (f"SamplingParams.{name}={value!r} is invalid{at}: must be {_describe(hint)}"
           + (f" (got {type(value).__name__})" if wrong_type and not where else "")
           + f"; e.g. SamplingParams({name}={_example(name)})")
    return TypeError(msg) if wrong_type else ValueError(msg)


def _example(name: str):
    return {"n": 1, "temperature": 0.0, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "seed": 0, "max_tokens": 64,
            "stop_token_ids": [2], "ignore_eos": True, "logprobs": 5, "stop": ["\n\n"],
            "include_stop_str_in_output": False, "skip_special_tokens": True, "prompt_logprobs": 1,
            "logprob_token_ids": [42, 7],
            "min_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
            "logit_bias": {42: -100.0}, "allowed_token_ids": [1, 2, 3], "bad_words": ["bad"],
            "bad_words_token_ids": [[7, 8]]}[name]
