"""Per-request sampling parameters (vLLM-like). Knows nothing about models or tensors.

Every field is typed with its range (``Annotated[..., Meta(...)]``) and checked by msgspec on
construction, so ``max_tokens=1.5``, ``seed=1.5`` or ``stop_token_ids=[-1]`` are refused instead of
coerced: TypeError for the wrong kind of value, ValueError for one out of range.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated

import msgspec
from msgspec import Meta


def _m(description: str, **bounds) -> Meta:
    return Meta(description=description, **bounds)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one request samples. ``temperature == 0`` means greedy."""

    # completions per prompt; only 1 is supported
    n: Annotated[int, _m("1: only n=1 is supported; submit the prompt several times instead", ge=1, le=1)] = 1
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

    def __post_init__(self) -> None:
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
            "stop_token_ids": [2], "ignore_eos": True, "logprobs": 5}[name]
