"""The OpenAI-compatible HTTP app (FastAPI) over an AsyncLLMEngine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming when ``stream``, usage,
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).
Every request passes the door first (guard.py: Host, API key, Content-Type, body size). Bodies are decoded by
msgspec (openai_protocol.py) and checked against ``serve.limits`` (limits.py) in worker threads, with the
tokenizing: anything malformed or too big is a 400 naming the field, before anything reaches the engine, and
the event loop never waits on a prompt. A non-streaming request has a deadline (408 after it). A client that
disconnects has its requests aborted in the engine core (streaming: Starlette cancels the response's
generator; otherwise a watcher polls the connection). A dead engine core answers 503 and, with
``restart_on_failure``, is restarted in the background. Knows nothing about how tokens are made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse

from specdec.v1.async_engine import AsyncLLMEngine
from specdec.datamodel.outputs import RequestOutput
from specdec.serve.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, RequestError, decode_body, message_text,
)
from specdec.serve.compat import IGNORED_HEADER, Compat
from specdec.serve.guard import Guard, allowed_hosts_for
from specdec.serve.limits import ServeLimits, check_batch, check_limits, check_prompt_chars, max_prompt_chars
from specdec.serve.prom import ServerMetrics
from specdec.serve.spec_metrics import spec_decode_metrics
from specdec.serve.token_text import TokenText
from specdec.v1.client import EngineDeadError

logger = logging.getLogger("specdec.serve")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> Response:
    return _json({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class DeadlinePassed(Exception):
    """A non-streaming request ran past serve.limits.request_timeout_s."""


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several generators as they come; closing this closes (aborts) them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise
        else:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServer:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
                 restart_on_failure: bool = True, strict_fields: bool = False, limits: ServeLimits | None = None,
                 bind_host: str = "127.0.0.1", allowed_hosts: list[str] | None = None, protect_docs: bool = True,
                 cors_origins: list[str] | tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.limits = limits or ServeLimits()
        self.allowed_hosts = allowed_hosts_for(bind_host, allowed_hosts)  # None: any Host (a non-loopback bind)
        self.protect_docs = protect_docs
        self.cors_origins = list(cors_origins)
        # decoding, tokenizing and bad_words run here, never on the event loop (the tiny model's tokenizer took
        # 5.3 s for a 1.9 MB prompt); two threads: the machine's cores; requests beyond them queue here
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdec-serve")
        self.max_prompt_chars = max_prompt_chars(engine.tokenizer, engine.max_model_len)
        self.strict_fields = strict_fields  # a declared field the server ignores: 400 instead (compat.py)
        self.token_text = TokenText(engine.tokenizer)
        self.model_name = model_name
        self.api_key = api_key
        self.restart_on_failure = restart_on_failure
        self.metrics = ServerMetrics(model_name)
        self._restarting = False
        self.created = int(time.time())

    # ------------------------------------------------------------------ app
    def build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            if self.engine.client is None:
                await self.engine.start()
            self.engine.stat_listeners.append(self.metrics.on_step)
            monitor = asyncio.create_task(self._monitor()) if self.restart_on_failure else None
            try:
                yield
            finally:
                if monitor is not None:
                    monitor.cancel()
                await self.engine.shutdown_async()
                self._pool.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="specdec OpenAI-compatible server", lifespan=lifespan)
        app.state.openai_server = self

        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        # the door (guard.py: Host, API key, Content-Type, body size), then CORS outside it so a browser's
        # preflight is answered; with no origins configured no CORS header is ever sent
        app.add_middleware(Guard, api_key=self.api_key, max_body_bytes=self.limits.max_body_bytes,
                           allowed_hosts=self.allowed_hosts, protect_docs=self.protect_docs)
        if self.cors_origins:
            app.add_middleware(CORSMiddleware, allow_origins=self.cors_origins, allow_methods=["GET", "POST"],
                               allow_headers=["authorization", "content-type"])
        return app

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.engine.dead_error is not None and not self._restarting:
                self._restarting = True
                try:
                    logger.warning("engine core is dead (%s); restarting it", self.engine.dead_error)
                    await self.engine.restart()
                    self.metrics.on_restart()
                    logger.info("engine core restarted")
                except Exception as e:  # noqa: BLE001 - try again on the next tick
                    logger.error("engine core restart failed: %s", e)
                finally:
                    self._restarting = False

    # ------------------------------------------------------------------ simple routes
    async def health(self) -> Response:
        try:
            await self.engine.check_health()
        except EngineDeadError as e:
            return _error(503, f"engine core is not serving: {e}", None, "engine_dead")
        return _json({"status": "ok"})

    async def prometheus(self) -> Response:
        body = self.metrics.render(not self.engine.is_dead, self.engine.num_restarts)
        return Response(content=body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> Response:
        return _json({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                  "owned_by": "specdec", "max_model_len": self.engine.max_model_len}]})

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Response:
        try:
            req, prompts, params, compat = await self._off_loop(self._prepare_completion, await request.body())
        except RequestError as e:
            return _error(400, str(e), e.param)
        return await self._respond(request, "completions", req, prompts, params, chat=False, compat=compat)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req, prompts, params, compat = await self._off_loop(self._prepare_chat, await request.body())
        except RequestError as e:
            return _error(400, str(e), e.param)
        return await self._respond(request, "chat", req, prompts, params, chat=True, compat=compat)

    async def _off_loop(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in the server's worker threads: the event loop keeps answering (/health, streams)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _prepare_completion(self, body: bytes):
        """(request, prompts as token ids, engine params, compat) of a completions body; RequestError (400)."""
        req = decode_body(body, CompletionRequest)
        check_limits(req, self.limits)
        req.check_combinations()
        self._check_model(req.model)
        compat = Compat.for_completion(req, self.token_text, self.strict_fields, req.request_id or "")
        prompts = req.prompts()
        check_batch(len(prompts), self.limits)
        for i, p in enumerate(prompts):  # a text that cannot fit is refused before it is tokenized
            check_prompt_chars([p], self.max_prompt_chars, self.engine.max_model_len,
                               "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        prompts = compat.tokenize(prompts, self.engine.max_model_len)
        params = compat.engine_params(self._params(req, prompts, req.max_tokens, 16, req.logprobs))
        return req, prompts, params, compat

    def _prepare_chat(self, body: bytes):
        """(request, [prompt as token ids], engine params, compat) of a chat body; RequestError (400)."""
        req = decode_body(body, ChatCompletionRequest)
        check_limits(req, self.limits)
        req.check_combinations()
        self._check_model(req.model)
        compat = Compat.for_chat(req, self.token_text, self.strict_fields, req.request_id or "")
        if not req.messages:
            raise RequestError("messages: is empty; send at least one message", "messages")
        conv = [{"role": m.role, "content": message_text(m.content, f"messages[{i}]")}
                | ({} if m.name is None else {"name": m.name}) for i, m in enumerate(req.messages)]
        # every text the template renders counts, roles and names too (a 2 MB role is refused untokenized)
        check_prompt_chars([t for m in conv for t in m.values()], self.max_prompt_chars, self.engine.max_model_len,
                           "messages")
        try:
            text = self.engine.tokenizer.apply_chat_template(conv, add_generation_prompt=req.add_generation_prompt,
                                                             continue_final_message=req.continue_final_message,
                                                             tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template error is the request's (roles, order)
            raise RequestError(f"messages: the model's chat template refused them: {e}", "messages") from None
        prompts = compat.tokenize([text], self.engine.max_model_len)  # add_special_tokens: false by default
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs: needs logprobs=true", "top_logprobs")
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._params(req, prompts, max_tokens, None, num_lp)
        return req, prompts, params, compat

    def _check_model(self, model: str | None) -> None:
        if model not in (None, self.model_name):
            raise RequestError(f"model: {model!r} is not served here; this server serves {self.model_name!r}", "model")

    def _params(self, req, prompts, max_tokens: int | None, default_max: int | None, num_logprobs):
        """SamplingParams for the request, every prompt checked against the context (400s, not 500s)."""
        room = None
        for i, p in enumerate(prompts):
            n = len(p["prompt_token_ids"]) if isinstance(p, dict) else len(self.engine.tokenizer(p)["input_ids"])
            left = self.engine.max_model_len - n
            if left < 1:
                raise RequestError(f"prompt{'' if len(prompts) == 1 else f'[{i}]'}: has {n} tokens, over this model's "
                                   f"context of {self.engine.max_model_len} tokens (max_model_len) with room for no "
                                   "output; shorten the prompt", "prompt" if not isinstance(req, ChatCompletionRequest)
                                   else "messages")
            if max_tokens is not None and n + max_tokens > self.engine.max_model_len:
                raise RequestError(f"max_tokens: {max_tokens} output tokens + {n} prompt tokens exceed this model's "
                                   f"context of {self.engine.max_model_len} tokens; ask for at most {left}",
                                   "max_tokens")
            room = left if room is None else min(room, left)
        default = room if default_max is None else min(default_max, room)
        params = req.sampling_params(default, num_logprobs)
        vocab = self.engine.processor.vocab_size
        if vocab is not None and params.top_k >= vocab:
            params.top_k = -1  # every token is in the top k: no top-k
        try:
            # once, here: bad_words tokenized (and deduplicated, O(words^2), bounded by max_bad_words) into
            # bad_words_token_ids; the engine gets the ids alone, so it does not tokenize them again on the loop
            params = self.engine.processor.check_params(params)
            if params.bad_words:
                params = params.clone()
                params.bad_words = None
            for p in prompts:  # token ids in range, etc.
                self.engine.processor.process("check", p, params)
        except (TypeError, ValueError) as e:
            m = re.search(r"SamplingParams\.(\w+)", str(e))
            where = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise RequestError(f"{where}: {e}" if m is None else str(e), m.group(1) if m else where) from None
        return params

    # ------------------------------------------------------------------ running
    async def _respond(self, request: Request, endpoint: str, req, prompts, params, chat: bool,
                       compat: Compat) -> Response:
        # the engine's ids are ours alone (a client's request_id is only echoed back as the response's id): two
        # requests with one id, or one named like another's child ("0_R"), can never share outputs
        internal = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        rid = req.request_id or internal
        gens = [self.engine.generate(p, params, f"{internal}-{i}") for i, p in enumerate(prompts)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        headers = {IGNORED_HEADER: ", ".join(compat.ignored)} if compat.ignored else None
        if req.stream:
            return StreamingResponse(self._stream(endpoint, rid, gens, params.n, chat, include_usage, compat,
                                                  req.return_spec_decode_metrics),
                                     media_type="text/event-stream", headers=headers)
        try:
            finals = await self._until_disconnect(request, self._collect(gens), self.limits.request_timeout_s)
        except ClientGone:
            return _error(499, "client closed the connection", None, "client_closed")
        except DeadlinePassed:
            return _error(408, f"the request ran past this server's deadline of {self.limits.request_timeout_s} s "
                          "and was aborted; ask for fewer max_tokens, stream it (\"stream\": true), or start the "
                          "server with serve.limits.request_timeout_s=<more>", None, "timeout")
        except EngineDeadError as e:
            return _error(503, f"the engine core failed while serving this request: {e}", None, "engine_dead")
        for out in finals:
            self.metrics.on_finished(endpoint, out)
        extra = {"spec_decode_metrics": spec_decode_metrics(finals)} if req.return_spec_decode_metrics else {}
        response = await self._off_loop(lambda: _json({**self._full_response(  # token texts decoded off the loop
            rid, [compat.output(o) for o in finals], compat.n, chat, compat), **extra}))
        response.headers.update(headers or {})
        return response

    async def _collect(self, gens) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, out in _merge(gens):
            finals[i] = out
        return finals  # type: ignore[return-value]

    async def _until_disconnect(self, request: Request, coro, timeout_s: float | None = None):
        task = asyncio.ensure_future(coro)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone()
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlinePassed()
        finally:
            if not task.done():
                task.cancel()  # closes the generators: their requests are aborted in the core
                with contextlib.suppress(BaseException):
                    await task

    def _full_response(self, rid: str, finals: list[RequestOutput], n: int, chat: bool,
                       compat: Compat) -> dict[str, Any]:
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for comp in out.outputs:
                completion_tokens += len(comp.token_ids)
                choice: dict[str, Any] = {"index": i * n + comp.index, "finish_reason": comp.finish_reason,
                                          "stop_reason": comp.stop_reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": comp.text}
                    choice["logprobs"] = compat.chat_logprobs(comp)
                else:
                    choice["text"], choice["logprobs"] = compat.completion_choice(i, out, comp)
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = [None if d is None else {
                        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._token_str(t)}
                        for t, lp in d.items()} for d in out.prompt_logprobs]
                choices.append(choice)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def _stream(self, endpoint, rid, gens, n, chat, include_usage, compat: Compat,
                      want_spec_metrics: bool = False) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        usage_prompt = usage_completion = 0
        made: dict[int, int] = {}  # tokens so far per choice (continuous_usage_stats)
        finals: list[RequestOutput] = []  # want_spec_metrics: summed into the last chunk

        def chunk(choices, usage=None, extra=None) -> bytes:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = compat.usage(sum(made.values())) if usage is None and compat.continuous_usage else usage
            body.update(extra or {})
            return b"data: " + msgspec.json.encode(body) + b"\n\n"

        try:
            if chat:
                for i in range(len(gens) * n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async for i, out in _merge(gens):
                out = compat.output(out)  # a scored-only prompt's dropped token
                choices = []
                for comp in out.outputs:
                    idx = i * n + comp.index
                    made[idx] = len(comp.token_ids)
                    first = idx not in sent_text
                    text = comp.text[sent_text.get(idx, 0):]
                    done = comp.finish_reason is not None
                    if compat.hold(out, first) or not text and not done and not (first and compat.echo):
                        continue
                    sent_text[idx] = len(comp.text)
                    c: dict[str, Any] = {"index": idx, "finish_reason": comp.finish_reason if done else None}
                    start = sent_lp.get(idx, 0)
                    if comp.logprobs is not None:
                        sent_lp[idx] = len(comp.logprobs)
                    if chat:
                        c["delta"] = {"content": text} if text else {}
                        lp = compat.chat_logprobs(comp, start, text)
                    else:
                        c["text"], lp = compat.completion_choice(i, out, comp, start, text, first)
                    c["logprobs"] = lp
                    if done:
                        c["stop_reason"] = comp.stop_reason
                    choices.append(c)
                if out.finished:
                    usage_prompt += len(out.prompt_token_ids)
                    usage_completion += sum(len(c.token_ids) for c in out.outputs)
                    self.metrics.on_finished(endpoint, out)
                    finals.append(out)
                if choices:
                    yield chunk(choices)
            if include_usage or want_spec_metrics:
                yield chunk([], {"prompt_tokens": usage_prompt, "completion_tokens": usage_completion,
                                 "total_tokens": usage_prompt + usage_completion},
                            {"spec_decode_metrics": spec_decode_metrics(finals)} if want_spec_metrics else None)
        except EngineDeadError as e:
            yield b"data: " + msgspec.json.encode({"error": {
                "message": f"the engine core failed while serving this request: {e}", "type": "engine_dead",
                "param": None, "code": 503}}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ logprobs in OpenAI's shapes
    def _token_str(self, tok: int) -> str:
        # ids past the tokenizer's vocabulary (a model's padded embedding rows) have no string: vLLM's form
        return self.engine.tokenizer.convert_ids_to_tokens(tok) or f"token_id:{tok}"
