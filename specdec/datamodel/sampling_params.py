"""Per-request sampling parameters (vLLM-like). Knows nothing about models or tensors.

Every field is typed with its range (``Annotated[..., Meta(...)]``) and checked by msgspec on
construction, so ``max_tokens=1.5``, ``seed=1.5`` or ``stop_token_ids=[-1]`` are refused instead of
coerced: TypeError for the wrong kind of value, ValueError for one out of range.

Two kinds of fields:
- fields that do not change the token distribution: ``n`` (parallel samples, each child seeded
  ``seed + i``), ``stop`` strings, ``skip_special_tokens``, ``prompt_logprobs``, ``logprob_token_ids``;
- logits processors (``min_tokens``, penalties, ``logit_bias``, ``allowed_token_ids``, ``bad_words``),
  applied by :mod:`specdec.sampling.logits_process` to the target's logits, conditioned on each position's prefix;
- ``num_speculative_tokens``: the most draft tokens per step this request gets (0 = none), whatever the speculation
  policy chooses (specdec/spec_decode/policy.py); it never changes the output;
- ``guided_decoding`` (:class:`GuidedDecodingParams`, vLLM's shape): a grammar (JSON schema, regex, choice, EBNF,
  any JSON object) whose mask :mod:`specdec.sampling.guided` applies at every position, given its prefix.
  The grammar is parsed here (xgrammar, no tokenizer), so a bad schema or regex is refused on construction.
"""

from __future__ import annotations

import json as _json
import math
import re
import typing
from typing import Annotated, Any

import msgspec
from msgspec import Meta


def _m(description: str, **bounds) -> Meta:
    return Meta(description=description, **bounds)


GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GuidedDecodingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Structured output: the output must match exactly one grammar (vLLM's ``GuidedDecodingParams``).

    Checked on construction: exactly one kind is set, and its grammar parses (xgrammar's JSON-schema, regex
    and EBNF front ends, which need no tokenizer), else a ValueError naming the field and the parser's reason.
    The output ends with the model's EOS once the grammar is complete."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF (GBNF) grammar whose start rule is ``root``
    json_object: bool = False  # any JSON object (OpenAI's response_format={"type": "json_object"})
    # JSON kinds: no whitespace between a JSON value's tokens (vLLM's option); False = any whitespace, which a
    # small model may repeat until max_tokens
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        on = [k for k in GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(on) != 1:
            raise ValueError(f"GuidedDecodingParams has {on or 'none'} set: set exactly one of "
                             f"{', '.join(GUIDED_KINDS)}; e.g. GuidedDecodingParams(regex='[0-9]+')")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"GuidedDecodingParams.choice={self.choice!r:.120} is invalid: must be a non-empty list "
                             "of non-empty strings; e.g. choice=['yes', 'no']")
        self.to_xgrammar()  # parses: raises naming the field

    @property
    def kind(self) -> str:
        """The one grammar field that is set."""
        return next(k for k in GUIDED_KINDS if getattr(self, k) not in (None, False))

    def schema_text(self) -> str | None:
        """The JSON schema as text (None for the other kinds); raises naming the field when it is not JSON."""
        if self.json is None or isinstance(self.json, dict):
            return None if self.json is None else _json.dumps(self.json)
        try:
            _json.loads(self.json)
        except ValueError as e:
            raise ValueError(f"GuidedDecodingParams.json={self.json!r:.120} is invalid: not JSON ({e}); pass a JSON "
                             "schema as a dict or its JSON text") from None
        return self.json

    def to_xgrammar(self) -> Any:
        """This grammar as an ``xgrammar.Grammar`` (tokenizer-free); a ValueError names the field on a parse error."""
        import xgrammar as xgr  # the grammar library (experiments/bench/guided_libs.py says why this one)

        kind = self.kind
        compact = self.disable_any_whitespace
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(self.schema_text(), any_whitespace=not compact)
            if kind == "json_object":
                if compact:
                    return xgr.Grammar.from_json_schema(_json.dumps({"type": "object"}), any_whitespace=False)
                return xgr.Grammar.builtin_json_grammar()
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":  # JSON string literals are EBNF string literals (same escapes)
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False)
                                                                      for c in self.choice))
            return xgr.Grammar.from_ebnf(self.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            if str(e).startswith("GuidedDecodingParams."):
                raise
            value = getattr(self, kind)
            # xgrammar words it "[time] /project/cpp/regex_converter.cc:83: Regex parsing error at ..."
            reason = re.sub(r"^.*?\S+\.cc:\d+: ", "", str(e).strip()).rstrip(".") or type(e).__name__
            raise ValueError(f"GuidedDecodingParams.{kind}={value!r:.120} is invalid: {reason}; "
                             f"fix the {_WHAT[kind]}") from None


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "choices",
         "grammar": "EBNF grammar (its start rule is `root ::= ...`)", "json_object": "option"}


GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, dict=True):
    """How one request samples. ``temperature == 0`` means greedy.

    ``dict=True`` lets the engine attach private attributes (``_eos_token_id`` for min_tokens) that are
    never serialised."""

    # completions per prompt: n child requests, child i seeded seed + i (unseeded when seed is None)
    n: Annotated[int, _m("an int in [1, 128]", ge=1, le=128)] = 1
    # 0 = greedy (argmax); > 0 divides the logits. Below GREEDY_BELOW it is taken as 0 (vLLM's rule): logits
    # divided by a temperature near float32's smallest overflow to inf and the row would sample garbage
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
    # -- structured output: a grammar masks every position (specdec/sampling/guided.py); None = off
    guided_decoding: Annotated[GuidedDecodingParams, _m("None or GuidedDecodingParams(json=..., regex=..., "
                                                        "choice=..., grammar=... or json_object=True)")] | None = None
    # -- speculative decoding, per request (does not change the distribution): at most this many draft tokens per
    # step (a tree: nodes), under any speculation policy; 0 = no speculation for this request; None = the engine's
    num_speculative_tokens: Annotated[int, _m("None or an int in [0, 2**31) (0 = no speculation for this request)",
                                              ge=0, le=2**31 - 1)] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a bare str is one stop string, as in OpenAI's API
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict) and any(isinstance(k, str) for k in self.logit_bias):
            # JSON object keys are strings ({"50256": -100}): a key of digits is that token id
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.guided_decoding, dict):  # e.g. from JSON: the struct's own checks word the error
            try:
                self.guided_decoding = msgspec.convert(self.guided_decoding, GuidedDecodingParams)
            except msgspec.ValidationError as e:
                raise ValueError(f"SamplingParams.guided_decoding: {str(e).partition(' - at `$')[0]}") from None
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
        if 0.0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # as greedy (see the field): the same tokens a sampler would pick, near ties aside
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} is invalid: must be <= max_tokens="
                             f"{self.max_tokens}; raise max_tokens or lower min_tokens")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("SamplingParams.allowed_token_ids=[] is invalid: it would allow no token; pass at "
                             "least one id, or None for all")
        if self.bad_words_token_ids is not None and any(not w for w in self.bad_words_token_ids):
            raise ValueError(f"SamplingParams.bad_words_token_ids={self.bad_words_token_ids!r:.80} is invalid: each "
                             "bad word is a non-empty list of token ids")

    def check(self) -> "SamplingParams":
        """The fields checked again, as at construction (a field set since then is checked where the request is
        admitted: one set to a bad value used to run unchecked, and fail the step of every request beside it)."""
        self.__post_init__()
        return self

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
            "bad_words_token_ids": [[7, 8]], "guided_decoding": "GuidedDecodingParams(regex='[0-9]+')",
            "num_speculative_tokens": 0}[name]
