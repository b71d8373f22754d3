"""What one request may ask of the server (``serve.limits`` in conf/serve/default.yaml), and the check.

Every bound has a default a user can raise; a request over one is a 400 naming the field, the limit and the
config key that raises it. The prompt's tokens need no limit here: the model's context bounds them
(``max_model_len``, checked where the prompt is tokenized). Knows nothing about HTTP or engines.
"""

from __future__ import annotations

from typing import Any

import msgspec

from specdec.serve.openai_protocol import RequestError


class ServeLimits(msgspec.Struct, forbid_unknown_fields=True):
    max_body_bytes: int = 2 * 1024 * 1024  # a 2,048-token prompt is ~10 KB of text; refused before it is read
    max_n: int = 16  # choices per prompt
    max_batch_size: int = 32  # prompts in one completions request (a list of prompts)
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's max_logprobs)
    max_logprob_token_ids: int = 32  # ids whose logprobs come with every generated token (a dict entry each)
    max_stop: int = 16  # stop strings
    max_stop_length: int = 256  # characters in one stop string or bad word
    max_stop_token_ids: int = 64
    max_bad_words: int = 64  # each is tokenized twice and checked at every scored position
    max_allowed_token_ids: int = 8192
    max_logit_bias: int = 1024  # entries
    max_request_id_length: int = 128
    # a structured output's grammar (JSON schema, regex, EBNF or choices) as JSON: xgrammar's compile time grows
    # steeply with it (5,000 choices, 93 KB: 0.4 s; 10,000, 188 KB: 3.8 s; 60,000: ~2 min), on a core of ours
    max_guided_bytes: int = 65536
    request_timeout_s: float | None = 600.0  # a non-streaming request's deadline (408 after it); null: none

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"serve.limits.{name}={v} must be positive (raise a limit, don't zero it)")


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")


def _over(field: str, got: int, limit: int, key: str, what: str) -> RequestError:
    return RequestError(f"{field}: {got} {what} is over this server's limit of {limit}; send fewer, or start the "
                        f"server with serve.limits.{key}=<more>", field)


def check_limits(req: Any, limits: ServeLimits) -> None:
    """RequestError naming the first field of a decoded request (completions or chat) over a limit."""
    L = limits
    if req.n > L.max_n:
        raise _over("n", req.n, L.max_n, "max_n", "choices")
    best_of = getattr(req, "best_of", None)  # completions only: best_of candidates are decoded as choices
    if best_of is not None and best_of > L.max_n:
        raise _over("best_of", best_of, L.max_n, "max_n", "candidates")
    for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
        v = getattr(req, field, None)
        if type(v) is int and v > L.max_logprobs:  # chat's logprobs is a bool
            raise _over(field, v, L.max_logprobs, "max_logprobs", "logprobs per token")
    for field, key, what in (("logprob_token_ids", "max_logprob_token_ids", "token ids"),
                             ("stop_token_ids", "max_stop_token_ids", "token ids"),
                             ("allowed_token_ids", "max_allowed_token_ids", "token ids"),
                             ("bad_words", "max_bad_words", "words"),
                             ("logit_bias", "max_logit_bias", "entries")):
        v = getattr(req, field)
        if v is not None and len(v) > getattr(L, key):
            raise _over(field, len(v), getattr(L, key), key, what)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stop) > L.max_stop:
        raise _over("stop", len(stop), L.max_stop, "max_stop", "strings")
    for field, words in (("stop", stop), ("bad_words", req.bad_words or [])):
        for i, w in enumerate(words):
            if len(w) > L.max_stop_length:
                raise _over(f"{field}[{i}]" if field == "bad_words" or not isinstance(req.stop, str) else field,
                            len(w), L.max_stop_length, "max_stop_length", "characters")
    for field in GUIDED_FIELDS:
        v = getattr(req, field, None)
        if v is not None:
            size = len(msgspec.json.encode(v))
            if size > L.max_guided_bytes:
                raise _over(field, size, L.max_guided_bytes, "max_guided_bytes", "bytes of grammar")
    if req.request_id is not None and len(req.request_id) > L.max_request_id_length:
        raise _over("request_id", len(req.request_id), L.max_request_id_length, "max_request_id_length",
                    "characters")


def check_batch(num_prompts: int, limits: ServeLimits) -> None:
    if num_prompts > limits.max_batch_size:
        raise _over("prompt", num_prompts, limits.max_batch_size, "max_batch_size", "prompts")


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a text prompt can have and still fit the context, or None where no bound is known.

    No token covers more characters than the vocabulary's longest piece (a byte-level piece spells each byte
    of its text as one character, so a piece is never shorter than its text), so a text longer than
    ``max_model_len`` times that piece is over the context without tokenizing it: a 2 MB prompt is refused in
    microseconds instead of ~5 s of tokenizer (whose list building holds the GIL). None when the tokenizer
    normalizes text first (a normalizer could shorten it) or has no readable vocabulary.
    """
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        longest = max(len(piece) for piece in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - an unusual tokenizer: no shortcut, it is tokenized as it comes
        return None
    return max_model_len * max(longest, 1)


def check_prompt_chars(texts: list[Any], bound: int | None, max_model_len: int, field: str) -> None:
    """RequestError when the text prompts (the strings among ``texts``) cannot fit the context (see above)."""
    if bound is None:
        return
    size = sum(len(t) for t in texts if isinstance(t, str))
    if size > bound:
        raise RequestError(f"{field}: {size} characters cannot fit this model's context of {max_model_len} tokens "
                           f"(no token of its vocabulary covers more than {bound // max_model_len} characters); "
                           "shorten the prompt", field)
