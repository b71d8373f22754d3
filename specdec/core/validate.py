"""Checks at the door: prompts, sampling parameters and engine arguments, before anything is admitted.

Each check raises TypeError (wrong kind of value) or ValueError (right kind, outside its range) with a
message that names the field, the value, the valid range and the way out. Types are checked by msgspec
(``msgspec.convert`` against ``Annotated[..., Meta(...)]``), so ``1.7``, ``'42'``, ``True`` and ``None``
are refused as token ids instead of being coerced. Knows nothing about models beyond a vocabulary size.
"""

from __future__ import annotations

import numbers
from functools import lru_cache
from typing import Annotated, Any

import msgspec

from specdec.datamodel.sampling_params import SamplingParams
from specdec.sampling.guided import GrammarCompiler


@lru_cache(maxsize=8)
def _token_list_type(vocab_size: int | None) -> Any:
    bound = msgspec.Meta(ge=0) if vocab_size is None else msgspec.Meta(ge=0, lt=vocab_size)
    return list[Annotated[int, bound]]


def _range(vocab_size: int | None) -> str:
    return "ints >= 0" if vocab_size is None else f"ints in [0, {vocab_size}) (the model's vocab_size)"


def check_token_ids(token_ids: Any, vocab_size: int | None, field: str = "prompt_token_ids") -> list[int]:
    """``token_ids`` as a list of Python ints, each in [0, vocab_size); raises naming the first bad one.

    NumPy arrays and torch tensors are accepted through ``.tolist()``; floats, strings, bools and None
    are refused, never coerced (``int(1.7)`` would silently drop the fraction)."""
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"{field}={token_ids!r:.80} must be a list of token ids ({_range(vocab_size)}); "
                        "pass e.g. {'prompt_token_ids': [1, 2, 3]} or a text prompt")
    try:
        return msgspec.convert(token_ids, _token_list_type(vocab_size))
    except msgspec.ValidationError:
        pass
    out = []
    for i, t in enumerate(token_ids):  # the slow path words the error (and takes NumPy ints)
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{field}[{i}]={t!r:.40} is a {type(t).__name__}: token ids must be "
                            f"{_range(vocab_size)}; tokenize text with this model's tokenizer")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{field}[{i}]={t} is out of range: token ids must be {_range(vocab_size)}; "
                             "tokenize with this model's tokenizer")
        out.append(int(t))
    return out


def as_sampling_params(params: Any, where: str = "sampling_params") -> SamplingParams:
    """A SamplingParams from one, a dict of its fields, or None (the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params.check()
    if isinstance(params, dict):
        unknown = sorted(set(params) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; valid keys: "
                             f"{', '.join(SamplingParams.__struct_fields__)}")
        return SamplingParams(**params)
    raise TypeError(f"{where}={params!r:.80} must be a SamplingParams, a dict of its fields or None; "
                    "pass e.g. SamplingParams(max_tokens=64) or {'max_tokens': 64}")


def check_stop_token_ids(params: SamplingParams, vocab_size: int | None) -> None:
    if vocab_size is not None:
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids has {bad}, out of range: they must be "
                             f"{_range(vocab_size)}, or they could never stop the request")


def check_int(component: str, name: str, value: Any, lo: int, hint: str = "") -> int:
    """An int argument >= lo (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{component}: {name}={value!r} must be an int >= {lo}{hint}")
    if value < lo:
        raise ValueError(f"{component}: {name}={value!r} must be an int >= {lo}{hint}")
    return value


def check_token_fields(params: SamplingParams, vocab_size: int | None) -> None:
    """The token ids inside logit_bias, allowed_token_ids, bad_words_token_ids and logprob_token_ids are in
    the vocabulary."""
    if vocab_size is None:
        return
    fields = {"logit_bias": list(params.logit_bias or {}), "allowed_token_ids": params.allowed_token_ids or [],
              "logprob_token_ids": params.logprob_token_ids or [],
              "bad_words_token_ids": [t for w in params.bad_words_token_ids or [] for t in w]}
    for name, ids in fields.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.{name} has token ids {bad[:8]} out of range: they must be "
                             f"{_range(vocab_size)}; tokenize with this model's tokenizer")
    for name in ("logprobs", "prompt_logprobs"):  # top-n over the vocabulary: n past it has no meaning
        n = getattr(params, name)
        if n is not None and n > vocab_size:
            raise ValueError(f"SamplingParams.{name}={n} is invalid: at most the vocabulary's {vocab_size} tokens; "
                             f"ask for fewer")


def with_bad_words_tokenized(params: SamplingParams, tokenizer) -> SamplingParams:
    """``params`` with ``bad_words`` tokenized into ``bad_words_token_ids`` (each word as it is and after a
    space, as a word inside a text is tokenized), when there are bad words and a tokenizer."""
    if not params.bad_words or tokenizer is None:
        return params
    seqs = list(params.bad_words_token_ids or [])
    for word in params.bad_words:
        for form in (word, " " + word.lstrip()):
            ids = tokenizer(form, add_special_tokens=False)["input_ids"]
            if ids and ids not in seqs:
                seqs.append(ids)
    out = params.clone()
    out.bad_words_token_ids = seqs
    return out


def grammar_compiler(tokenizer, vocab_size: int | None, eos_token_id: int | None) -> GrammarCompiler:
    """The compiler of guided_decoding's grammars for this tokenizer (its EOS ends every grammar); refused without
    a tokenizer, since a grammar constrains text."""
    if tokenizer is None:
        raise ValueError("SamplingParams.guided_decoding needs the model's tokenizer (a grammar constrains text), but "
                         "this engine has none; build it through specdec.LLM, or drop guided_decoding")
    return GrammarCompiler(tokenizer, vocab_size if vocab_size is not None else len(tokenizer),
                           None if eos_token_id is None else [eos_token_id])
