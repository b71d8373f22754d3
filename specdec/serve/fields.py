"""The request fields the server accepts but does not implement, and which of them a request really used.

Real clients send fields of OpenAI's API and vLLM's extensions that this server has no use for (``tools``,
``logits_processors``, ``priority``, ...). Refusing them breaks those clients; silently
ignoring a field that asks for behaviour hides a wrong answer. So each such field is declared here with the
values that ask for nothing (``null``, ``false``, ``priority: 0``, ``modalities: ["text"]``, ...):
a request sending only those is served as it is; one asking for more is served with the field ignored, a
logged warning and a response header, or refused with a 400 under ``serve.strict_fields`` (specdec.serve.compat
does both). A field of the other endpoint (``tools`` on /v1/completions) stays an unknown field.

The fields the server implements are declared in openai_protocol.py with their types and ranges; a bad value
there is a 400 naming the field (structured outputs among them: ``response_format``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_decoding_backend``, ``structured_outputs``). Field lists: OpenAI's completions and chat create params (openai 1.x types),
vLLM's CompletionRequest / ChatCompletionRequest (vllm/entrypoints/openai/protocol.py, 0.8-0.11).
Knows nothing about HTTP, engines or tokenizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

Neutral = Callable[[Any], bool]  # True: the value asks for nothing the server would have to do


def _is(*values: Any) -> Neutral:
    return lambda v: v is None or any(v == x and type(v) is type(x) or (v == x and isinstance(x, float))
                                      for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _any(v: Any) -> bool:  # informational: no value changes the output (user, metadata, cache salt, ...)
    return True


# name -> neutral(value). Both endpoints unless listed in CHAT_ONLY / COMPLETIONS_ONLY.
IGNORED: dict[str, Neutral] = {
    # OpenAI (both endpoints, or chat)
    "user": _any,  # informational in OpenAI's API too
    "suffix": lambda v: v is None or v == "",  # completions: text after the insertion point
    "metadata": _any,
    "store": _is(False),
    "service_tier": _is("auto", "default"),
    "safety_identifier": _any,
    "prompt_cache_key": _any,
    "prompt_cache_retention": _any,
    "prompt_cache_options": _any,
    "tools": _empty,
    "tool_choice": _is("none", "auto"),  # "auto" with no tools chooses none
    "parallel_tool_calls": _any,  # meaningless without tools
    "functions": _empty,
    "function_call": _is("none", "auto"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is(),
    "prediction": _is(),
    "reasoning_effort": _is(),
    "verbosity": _is(),
    "web_search_options": _is(),
    "moderation": _is(),
    # vLLM's extensions
    "use_beam_search": _is(False),
    "length_penalty": _is(1.0),
    "watermarking": _is(False),
    "priority": _is(0),
    "session_id": _any,
    "cache_salt": _any,  # salts a cross-request prefix cache; this server shares no KV across requests
    "logits_processors": _empty,
    "guided_whitespace_pattern": _is(),  # the JSON grammars' whitespace: xgrammar takes none (any, or none)
    "structural_tag": _is(),
    "spaces_between_special_tokens": _is(True),  # fast tokenizers decode without such spaces (vLLM's too)
    "return_token_ids": _is(False),
    "return_token_offsets": _is(False),
    "return_mm_kwargs": _is(True),
    "prompt_embeds": _is(),
    "kv_transfer_params": _is(),
    "ec_transfer_params": _is(),
    "vllm_xargs": _empty,
    "repetition_detection": _is(),
    "thinking_token_budget": _is(-1),
    "stream_interval": _is(1),
    "routed_experts_prompt_start": _is(0),
    # vLLM's chat extensions
    "echo": _is(False),  # chat's echo: prepend the last message when it has the assistant's role
    "documents": _empty,
    "chat_template": _is(),
    "chat_template_kwargs": _empty,
    "mm_processor_kwargs": _empty,
    "media_io_kwargs": _empty,
    "include_reasoning": _is(True),
    "tool_parser": _any,
}
CHAT_ONLY = frozenset({
    "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "modalities", "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options", "moderation",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs",
    "include_reasoning", "tool_parser", "thinking_token_budget"})
COMPLETIONS_ONLY = frozenset({"suffix", "prompt_embeds"})
# chat's `echo` is the ignored field above; completions' `echo` is implemented (openai_protocol.py) and
# replaces it there. `user` is accepted by both endpoints.


def _known_fields_struct() -> type:
    """A msgspec base struct with one ``Any`` field per IGNORED name, UNSET when the request leaves it out."""
    fields = [(name, Any | UnsetType, UNSET) for name in IGNORED]
    return msgspec.defstruct("KnownFields", fields, kw_only=True, module=__name__)


# The request structs derive from this: every declared field decodes (a truly unknown one is still refused)
KnownFields = _known_fields_struct()


def ignored_fields(req: Any, endpoint: str) -> tuple[list[str], list[str]]:
    """(the declared-but-unimplemented fields ``req`` sets to a value that asks for something, the fields it
    sets that belong to the other endpoint). ``endpoint``: "completions" or "chat"."""
    other = CHAT_ONLY if endpoint == "completions" else COMPLETIONS_ONLY
    # a declared name the endpoint's struct redefines (completions' echo) is implemented there
    implemented = {f.name for f in msgspec.structs.fields(type(req)) if f.default is not UNSET}
    asked, foreign = [], []
    for name, neutral in IGNORED.items():
        if name in implemented:
            continue
        value = getattr(req, name, UNSET)
        if value is UNSET:
            continue
        if name in other:
            foreign.append(name)
        elif not neutral(value):
            asked.append(name)
    return asked, foreign
