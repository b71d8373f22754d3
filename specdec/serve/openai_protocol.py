"""The OpenAI API's request bodies as msgspec structs, and their mapping onto SamplingParams.

A body is decoded with its type in one pass: malformed JSON, an unknown field, a wrong type or a value
out of range becomes :class:`RequestError` (HTTP 400) naming the field, e.g. ``max_tokens: Expected `int`,
got `str```. OpenAI's fields plus the engine's extras (top_k, min_p, min_tokens, repetition_penalty,
stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output, allowed_token_ids,
bad_words, seed, prompt_logprobs, logprob_token_ids; num_speculative_tokens, a per-request cap on drafts, 0 = no
speculation; return_spec_decode_metrics, specdec.serve.spec_metrics), as vLLM's server accepts them. Structured outputs
(``response_format``, ``guided_*``, ``structured_outputs``) become ``SamplingParams.guided_decoding``; a bad
schema or regex is a 400 naming the field it came in. Knows nothing about engines or HTTP.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from specdec.datamodel.sampling_params import GuidedDecodingParams, SamplingParams
from specdec.serve.fields import KnownFields


_TOKEN_ID = re.compile(r"[0-9]{1,10}")
_PromptId = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class RequestError(ValueError):
    """A request the server refuses with 400: ``param`` names the field, the message says why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM: with include_usage, every chunk carries the usage so far
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events: none is sent here


class _Sampling(KnownFields, kw_only=True, forbid_unknown_fields=True):
    """The sampling fields both endpoints take (None: the engine's default); KnownFields: the declared
    fields the server ignores (specdec.serve.fields)."""

    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0: completions with echo only (compat.py)
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    n: Annotated[int, Meta(ge=1)] = 1  # at most serve.limits.max_n (limits.py), as every list here
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    user: str | None = None
    # the engine's extras
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # over the vocabulary: off (-1)
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0)] | None = None  # per prompt token, as vLLM returns them
    # also the logprobs of these ids at every emitted token: they join that token's top_logprobs entries
    logprob_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    request_id: str | None = None  # the engine's request id (default: a fresh one)
    # at most this many drafts per step; 0 = off (bounded: 2**64 cannot cross to the engine core)
    num_speculative_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    # the response's speculative metrics as a top-level "spec_decode_metrics" object (streaming: in the last chunk)
    return_spec_decode_metrics: bool = False
    # vLLM's prompt and token-naming extensions (specdec.serve.compat)
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None  # keep this many prompt tokens (-1: context)
    truncation_side: Literal["left", "right"] | None = None  # which to keep: the last (default) or the first
    return_tokens_as_token_ids: bool | None = None  # logprob tokens named "token_id:N"
    # structured outputs (one at most; guided_decoding() maps them): OpenAI's response_format, vLLM's guided_*
    # fields (0.8-0.10) and structured_outputs (0.10.2+)
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    guided_json: dict[str, Any] | str | None = None  # a JSON schema
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # EBNF (GBNF), start rule `root`
    guided_decoding_backend: str | None = None  # any backend name runs on xgrammar; ":disable-any-whitespace" kept
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}

    def check_combinations(self) -> None:
        """RequestError naming a field that would do nothing beside the others (vLLM refuses these too;
        ``stream_options`` without ``stream``, which some clients send, is served and named as ignored instead:
        specdec.serve.compat.check_fields)."""
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs: not available with stream=true; set stream=false (completions: "
                               "or echo=true with logprobs, which streams the prompt's logprobs)", "prompt_logprobs")
        lp = getattr(self, "logprobs", None)  # chat: a bool; completions: None or an int
        if self.logprob_token_ids and not (lp is True or type(lp) is int):
            raise RequestError("logprob_token_ids: their logprobs come with the logprobs of each token; set "
                               "logprobs (completions: logprobs=0 or more; chat: logprobs=true)", "logprob_token_ids")

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The request's grammar, or None; RequestError naming the field for a bad schema / regex / shape."""
        return guided_decoding(self)

    def sampling_params(self, default_max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = {"n": self.n, "max_tokens": self.max_tokens or default_max_tokens}
        guided = self.guided_decoding()
        if guided is not None:
            kw["guided_decoding"] = guided
        for f in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                  "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                  "include_stop_str_in_output", "allowed_token_ids", "bad_words", "stop", "prompt_logprobs",
                  "logprob_token_ids", "num_speculative_tokens"):
            v = getattr(self, f)
            if v is not None:
                kw[f] = v
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                if not _TOKEN_ID.fullmatch(k):  # ASCII digits only: "²" passes isdigit() and fails int()
                    raise RequestError(f"logit_bias: key {k!r:.40} is not a token id; keys are token ids as strings, "
                                       'e.g. {"42": -100}', "logit_bias")
                bias[int(k)] = v
            kw["logit_bias"] = bias
        if num_logprobs is not None:
            kw["logprobs"] = num_logprobs
        try:
            return SamplingParams(**kw)
        except (TypeError, ValueError) as e:
            m = re.search(r"SamplingParams\.(\w+)", str(e))
            raise RequestError(str(e), m.group(1) if m else None) from None


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    # a text, token ids, or a batch of either (see prompts()); typed to its depth, so no deeper nesting decodes
    # (ids checked against int32 here, the vocabulary later: a tokenizer overflows on -1 or 2**32 before that)
    prompt: str | list[str | _PromptId | list[_PromptId]]
    logprobs: Annotated[int, Meta(ge=0)] | None = None  # top logprobs per token (OpenAI: <= 5)
    echo: bool = False  # the prompt (and with logprobs its tokens' logprobs) before the completion
    best_of: Annotated[int, Meta(ge=1, le=128)] | None = None  # >= n: the n best of best_of (not streamed)
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt


    def prompts(self) -> list[str | dict[str, Any]]:
        """The batch of prompts: each a text or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt: is empty; send a string, token ids, or a list of either", "prompt")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [{"prompt_token_ids": p}]
        out: list[str | dict[str, Any]] = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
                out.append({"prompt_token_ids": x})
            else:
                raise RequestError(f"prompt[{i}]: {x!r:.60} is not a string or a non-empty list of token ids", "prompt")
        return out


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the last message left open, continued by the model
    add_special_tokens: bool = False  # vLLM: specials on top of the chat template's (which has them)


def decode_body(body: bytes, typ: type) -> Any:
    """``body`` as ``typ``, or RequestError naming the field (malformed JSON, unknown field, type, range)."""
    if not body:
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.search(r"at `\$\.?([^`]*)`", msg)
        field = m.group(1) if m else None
        unknown = re.search(r"Object contains unknown field `([^`]+)`", msg)
        if unknown:
            field = ((field + ".") if field else "") + unknown.group(1)
            msg = f"unknown field {unknown.group(1)!r}; see the OpenAI API reference for the valid fields"
        missing = re.search(r"Object missing required field `([^`]+)`", msg)
        if missing:
            field = ((field + ".") if field else "") + missing.group(1)
        raise RequestError(f"{field}: {msg}" if field else msg, field) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"malformed JSON: {e}") from None
    except RecursionError:
        raise RequestError("malformed JSON: nested too deeply; no field of this API nests more than a few "
                           "levels") from None
    except UnicodeDecodeError as e:
        raise RequestError(f"malformed JSON: not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text") from None
    except (ValueError, TypeError, OverflowError) as e:  # anything else msgspec raises is the body's fault too
        raise RequestError(f"malformed JSON: {type(e).__name__}: {e}") from None


def message_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                               "supported by this model", f"{where}.content")
        parts.append(part["text"])
    return "".join(parts)


# structured_outputs' keys (vLLM's StructuredOutputsParams) -> GuidedDecodingParams' field; the keys after it
_SO_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
_SO_NEUTRAL = {"disable_fallback": lambda v: True, "disable_additional_properties": lambda v: not v,
               "whitespace_pattern": lambda v: v is None, "structural_tag": lambda v: v is None,
               "_backend": lambda v: True, "_backend_was_auto": lambda v: True}


def _guided(kind: str, value: Any, where: str, compact: bool) -> GuidedDecodingParams:
    """GuidedDecodingParams(kind=value), or RequestError naming ``where`` (the grammar is parsed here)."""
    try:
        return GuidedDecodingParams(**{kind: value}, disable_any_whitespace=compact)
    except (TypeError, ValueError) as e:
        msg = re.sub(r"^GuidedDecodingParams\.\w+=", "", str(e))
        raise RequestError(f"{where}: {msg}", where.split(".")[0]) from None


def _response_format(rf: dict[str, Any], compact: bool) -> GuidedDecodingParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _guided("json_object", True, "response_format", compact)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError('response_format.json_schema: missing or not an object; send {"type": "json_schema", '
                               '"json_schema": {"name": ..., "schema": {...}}}', "response_format")
        schema = js.get("schema")
        if not isinstance(schema, (dict, str)):
            raise RequestError("response_format.json_schema.schema: missing or not a JSON schema object; send the "
                               'schema, e.g. {"type": "object", "properties": {...}}', "response_format")
        return _guided("json", schema, "response_format.json_schema.schema", compact)
    raise RequestError(f"response_format.type: {kind!r:.40} is not supported; send one of 'text', 'json_object', "
                       "'json_schema'", "response_format")


def _structured_outputs(so: dict[str, Any]) -> GuidedDecodingParams | None:
    on = {}
    for key, v in so.items():
        if key in _SO_KINDS:
            if v not in (None, False):
                on[key] = v
        elif key in _SO_NEUTRAL:
            if not _SO_NEUTRAL[key](v):
                raise RequestError(f"structured_outputs.{key}: is not supported by this server; drop it",
                                   "structured_outputs")
        elif key != "disable_any_whitespace":
            raise RequestError(f"structured_outputs.{key}: unknown key; the keys are "
                               f"{', '.join([*_SO_KINDS, 'disable_any_whitespace', *_SO_NEUTRAL][:-2])}",
                               "structured_outputs")
    if not on:
        return None
    if len(on) > 1:
        raise RequestError(f"structured_outputs: sets {', '.join(on)}; set exactly one", "structured_outputs")
    (key, v), = on.items()
    if key == "json_object" and v is not True:
        raise RequestError(f"structured_outputs.json_object: {v!r:.40} is not a bool", "structured_outputs")
    compact = so.get("disable_any_whitespace") is True
    return _guided(_SO_KINDS[key], v, f"structured_outputs.{key}", compact)


def guided_decoding(req: _Sampling) -> GuidedDecodingParams | None:
    """The structured output a request asks for (at most one field), or None (``response_format`` text)."""
    backend = req.guided_decoding_backend or ""
    compact = "disable-any-whitespace" in backend.partition(":")[2].split(",")  # vLLM 0.8's backend options
    found: list[tuple[str, GuidedDecodingParams]] = []
    if req.response_format is not None:
        g = _response_format(req.response_format, compact)
        if g is not None:
            found.append(("response_format", g))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        v = getattr(req, field)
        if v is not None and not (field == "guided_choice" and v == []):  # []: no choice asked (as before)
            found.append((field, _guided(kind, v, field, compact)))
    if req.structured_outputs is not None:
        g = _structured_outputs(req.structured_outputs)
        if g is not None:
            found.append(("structured_outputs", g))
    if len(found) > 1:
        raise RequestError(f"{found[1][0]}: the request also sets {found[0][0]}; ask for one structured output "
                           "(response_format, guided_json, guided_regex, guided_choice, guided_grammar or "
                           "structured_outputs)", found[1][0])
    return found[0][1] if found else None
