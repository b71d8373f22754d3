"""What real OpenAI clients need beyond sampling: the field policy, echo, best_of, token-level usage, token text.

Per request the server builds one :class:`Compat` (``for_completion`` / ``for_chat``) after decoding the body:

- **fields**: a declared field the server does not implement (specdec.serve.fields) that asks for something is
  ignored with a logged warning and the ``x-specdec-ignored-fields`` response header, or refused (400 naming
  it) with ``serve.strict_fields=true``; a field of the other endpoint is an unknown field (400).
- **prompts**: tokenized here, with ``add_special_tokens`` (completions: true, chat: false, as vLLM) and
  ``truncate_prompt_tokens`` / ``truncation_side``; the engine gets ids and the text they came from.
- **echo** (completions): the prompt's text comes first; with ``logprobs`` its tokens and logprobs too (the
  first token's null), from the engine's ``prompt_logprobs`` (one prefill of the prompt by the target alone:
  the same numbers with speculation on or off); ``max_tokens=0`` scores the prompt alone (the engine makes
  one token, which is dropped).
- **best_of** > n (completions, not streamed): best_of completions are made and the n with the highest
  cumulative logprob returned, in that order (vLLM v0's rule).
- **stream_options.continuous_usage_stats** (with include_usage): every chunk carries the request's usage so
  far (prompt tokens of all its prompts, completion tokens of all its choices so far); the last chunk the total.
- **logprob tokens as text** (specdec.serve.token_text), or ``"token_id:N"`` with ``return_tokens_as_token_ids``.

Knows nothing about HTTP or how tokens are made: it reads the request, the tokenizer and RequestOutputs.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from specdec.datamodel.outputs import CompletionOutput, RequestOutput
from specdec.datamodel.sampling_params import SamplingParams
from specdec.serve.fields import ignored_fields
from specdec.serve.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestError
from specdec.serve.token_text import TokenText

logger = logging.getLogger("specdec.serve")

IGNORED_HEADER = "x-specdec-ignored-fields"


def check_fields(req: Any, endpoint: str, strict: bool, rid: str = "") -> list[str]:
    """The fields ``req`` asks for that the server ignores (warned about here); RequestError for a field of the
    other endpoint, or for any such field under ``strict``."""
    asked, foreign = ignored_fields(req, endpoint)
    if req.stream_options is not None and not req.stream:  # implemented, but moot without stream
        asked.append("stream_options")
    if foreign:
        raise RequestError(f"{foreign[0]}: unknown field {foreign[0]!r} for /v1/{endpoint.replace('chat', 'chat/completions')}; "
                           "see the OpenAI API reference for the valid fields", foreign[0])
    if asked and strict:
        raise RequestError(f"{asked[0]}: is not implemented by this server (serve.strict_fields=true refuses it); "
                           f"drop it, or start the server with serve.strict_fields=false to have it ignored", asked[0])
    if asked:
        logger.warning("request %s: ignoring fields this server does not implement: %s (serve.strict_fields=true "
                       "refuses them)", rid or "?", ", ".join(asked))
    return asked


class Compat:
    """One request's compatibility decisions, and the reshaping of its outputs into OpenAI's forms."""

    def __init__(self, req: Any, endpoint: str, token_text: TokenText, ignored: list[str]) -> None:
        self.req = req
        self.endpoint = endpoint
        self.token_text = token_text
        self.ignored = ignored
        self.n = req.n  # choices per prompt the client gets
        self.best_of = req.n
        self.echo = False
        self.score_only = False  # max_tokens=0 with echo: the prompt's logprobs, no completion
        self.num_logprobs: int | None = None  # top logprobs per token the client gets (None: no logprobs)
        self.as_ids = bool(req.return_tokens_as_token_ids)
        so = req.stream_options
        self.continuous_usage = bool(so and so.include_usage and so.continuous_usage_stats)
        self.prompt_tokens = 0  # all prompts' tokens (set by tokenize)
        self.prompt_texts: list[str] = []

    # ------------------------------------------------------------------ building the request
    @classmethod
    def for_completion(cls, req: CompletionRequest, token_text: TokenText, strict: bool, rid: str = "") -> "Compat":
        c = cls(req, "completions", token_text, check_fields(req, "completions", strict, rid))
        c.echo = req.echo
        c.num_logprobs = req.logprobs
        if req.max_tokens == 0:
            if not req.echo:
                raise RequestError("max_tokens: 0 generates nothing; it is allowed only with echo=true (score the "
                                   "prompt: echo=true, logprobs=1, max_tokens=0)", "max_tokens")
            c.score_only = True
        if req.best_of is not None:
            if req.best_of < req.n:
                raise RequestError(f"best_of: {req.best_of} is below n={req.n}; best_of must be >= n", "best_of")
            if req.best_of > req.n and req.stream:
                raise RequestError("best_of: a best_of above n cannot be streamed (the best are known only at the "
                                   "end); send stream=false or best_of=n", "best_of")
            c.best_of = req.best_of
        return c

    @classmethod
    def for_chat(cls, req: ChatCompletionRequest, token_text: TokenText, strict: bool, rid: str = "") -> "Compat":
        c = cls(req, "chat", token_text, check_fields(req, "chat", strict, rid))
        if req.max_tokens == 0:
            raise RequestError("max_tokens: 0 generates nothing; send at least 1 (or max_completion_tokens)",
                               "max_tokens")
        if req.continue_final_message and req.add_generation_prompt:
            raise RequestError("continue_final_message: cannot be used with add_generation_prompt=true (which "
                               "starts a new assistant message); send add_generation_prompt=false", "continue_final_message")
        c.num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return c

    def tokenize(self, prompts: list[str | dict[str, Any]], max_model_len: int) -> list[dict[str, Any]]:
        """Every prompt as {"prompt_token_ids", "prompt"}: text tokenized with ``add_special_tokens``, ids kept;
        then truncated to ``truncate_prompt_tokens`` (-1: the model's context) from ``truncation_side``."""
        tok = self.token_text.tokenizer
        add = self.req.add_special_tokens
        keep = self.req.truncate_prompt_tokens
        if keep == -1:
            keep = max_model_len
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids, text = tok(p, add_special_tokens=add)["input_ids"], p
            else:
                ids, text = list(p["prompt_token_ids"]), p.get("prompt")
            if keep is not None and len(ids) > keep:
                ids = ids[:keep] if self.req.truncation_side == "right" else ids[len(ids) - keep:]
                text = None
            if text is None:
                text = tok.decode(ids, skip_special_tokens=False)
            out.append({"prompt_token_ids": ids, "prompt": text})
            self.prompt_texts.append(text)
            self.prompt_tokens += len(ids)
        return out

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """The params the engine runs: best_of candidates, one token to drop when scoring only, the prompt's
        logprobs for echo, token logprobs to rank best_of candidates by."""
        kw: dict[str, Any] = {}
        if self.best_of != params.n:
            kw["n"] = self.best_of
            if params.logprobs is None:
                kw["logprobs"] = 0  # the chosen tokens' logprobs: cumulative_logprob ranks the candidates
        if self.score_only:
            kw["max_tokens"], kw["min_tokens"] = 1, 0
        if self.echo and self.num_logprobs is not None:
            kw["prompt_logprobs"] = max(params.prompt_logprobs or 0, self.num_logprobs)
        if not kw:
            return params
        try:
            return msgspec.structs.replace(params, **kw)
        except (TypeError, ValueError) as e:
            m = re.search(r"SamplingParams\.(\w+)", str(e))
            raise RequestError(str(e), m.group(1) if m else None) from None

    # ------------------------------------------------------------------ reshaping the outputs
    def output(self, out: RequestOutput) -> RequestOutput:
        """``out`` as the client sees it: a scored-only prompt's dropped token, best_of's n best."""
        comps = out.outputs
        if self.score_only:
            comps = [msgspec.structs.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                             logprobs=None if c.logprobs is None else [],
                                             finish_reason=c.finish_reason and "length", stop_reason=None)
                     for c in comps]
        if self.best_of > self.n and out.finished:
            best = sorted(comps, key=lambda c: -(c.cumulative_logprob if c.cumulative_logprob is not None
                                                 else float("-inf")))[:self.n]
            comps = [msgspec.structs.replace(c, index=i, logprobs=c.logprobs if self.num_logprobs is not None
                                             else None) for i, c in enumerate(best)]
        if comps is out.outputs:
            return out
        return msgspec.structs.replace(out, outputs=comps)

    def hold(self, out: RequestOutput, first: bool) -> bool:
        """Whether a stream must hold a choice's first chunk: echo with logprobs needs the prompt's logprobs,
        which the engine core sends with the request's last output (the text waits with them; a request that
        ends without them, e.g. on an error, is sent with null logprobs for its prompt)."""
        return (first and self.echo and self.num_logprobs is not None and out.prompt_logprobs is None
                and not out.finished)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def completion_choice(self, i: int, out: RequestOutput, comp: CompletionOutput, start: int = 0,
                          text: str | None = None, first: bool = True) -> tuple[str, dict[str, Any] | None]:
        """(text, logprobs) of /v1/completions' choice for prompt ``i``: from token ``start`` (a stream's
        delta, whose ``text`` is given), the echoed prompt first when ``first``."""
        text = comp.text if text is None else text
        echo = self.echo and first
        prefix = self.prompt_texts[i] if echo else ""
        lp = None
        if self.num_logprobs is not None and comp.logprobs is not None:
            skip = self._skip()
            head = None
            if echo:
                plps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                head = self.token_text.completion_logprobs(
                    out.prompt_token_ids, plps, self.num_logprobs, skip_special_tokens=False, text=prefix,
                    as_ids=self.as_ids)
            # where token `start`'s text begins in the returned text (a stream's earlier chunks included)
            offset = (len(self.prompt_texts[i]) if self.echo else 0) + (len(comp.text) - len(text) if start else 0)
            lp = self.token_text.completion_logprobs(
                comp.token_ids, comp.logprobs[start:], self.num_logprobs, skip_special_tokens=skip,
                text=text if comp.finish_reason is not None else None, start=start, offset=offset, as_ids=self.as_ids)
            if head is not None:
                lp = {k: head[k] + lp[k] for k in lp}
        return prefix + text, lp

    def chat_logprobs(self, comp: CompletionOutput, start: int = 0, text: str | None = None) -> dict[str, Any] | None:
        """Chat's logprobs from token ``start`` (a stream's delta, whose ``text`` is given)."""
        if self.num_logprobs is None or comp.logprobs is None:
            return None
        text = comp.text if text is None else text
        return self.token_text.chat_logprobs(
            comp.token_ids, comp.logprobs[start:], self.num_logprobs, skip_special_tokens=self._skip(),
            text=text if comp.finish_reason is not None else None, start=start, as_ids=self.as_ids)

    def _skip(self) -> bool:
        return True if self.req.skip_special_tokens is None else self.req.skip_special_tokens
