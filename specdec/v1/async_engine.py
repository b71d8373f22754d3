"""AsyncLLMEngine: the asyncio front end of an engine core (after vLLM's AsyncLLM).

``async for out in engine.generate(prompt, params, request_id)`` yields cumulative RequestOutputs as the
core steps; cancelling (or closing) the generator aborts the request in the core. One output task reads
the core's stream and hands each request's outputs to its queue, so the front end's text work (detokenizing,
stop strings) runs while the core computes the next step.

The core runs in a spawned process (``AsyncEngineArgs.multiprocess=True``, the default) or in this process,
stepped in a worker thread. If the core process dies, every request in flight ends with an error,
``check_health()`` raises :class:`EngineDeadError`, and ``restart()`` starts a new core.
Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from specdec.entrypoints.engine_args import AsyncEngineArgs
from specdec.datamodel.outputs import RequestOutput
from specdec.datamodel.sampling_params import SamplingParams
from specdec.v1.client import EngineDeadError, InprocClient, MPClient
from specdec.v1.output_processor import OutputProcessor
from specdec.v1.processor import Processor
from specdec.datamodel.inputs import PromptType
from specdec.v1.protocol import EngineCoreOutputs, FinishReason

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError"]


class AsyncLLMEngine:
    def __init__(self, engine_args: AsyncEngineArgs) -> None:
        """Loads the tokenizer here; the model loads in the core when :meth:`start` runs (``from_engine_args``
        does both)."""
        from specdec.engine.loader import load_tokenizer, model_info

        self.args = engine_args
        self.tokenizer = load_tokenizer(engine_args.model)
        info = model_info(engine_args.model)
        self.max_model_len = engine_args.max_model_len
        self.processor = Processor(self.tokenizer, vocab_size=info.vocab_size, max_model_len=self.max_model_len,
                                   speculative=engine_args.is_speculative)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client: MPClient | InprocClient | None = None
        self._output_task: asyncio.Task | None = None
        self._utility: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.dead_error: str | None = None
        self.stat_listeners: list = []  # callables(SchedulerStats), e.g. the server's Prometheus counters
        self.num_restarts = 0

    @classmethod
    async def from_engine_args(cls, engine_args: AsyncEngineArgs) -> "AsyncLLMEngine":
        engine = cls(engine_args)
        await engine.start()
        return engine

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.args.multiprocess:
            self.client = await asyncio.to_thread(MPClient, self.args, self.args.startup_timeout_s)
        else:
            self.client = await asyncio.to_thread(InprocClient, self.args)
        self.dead_error = None
        self._output_task = asyncio.create_task(self._output_loop(self.client), name="specdec-output-loop")

    async def restart(self) -> None:
        """A new engine core (after a crash, or to reset everything); requests in flight end with an error."""
        await self.shutdown_async(reason="the engine core was restarted")
        self.num_restarts += 1
        await self.start()

    async def shutdown_async(self, reason: str = "the engine was shut down") -> None:
        task, self._output_task = self._output_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is being replaced anyway
                pass
        self._fail_all(reason)
        if self.client is not None:
            client, self.client = self.client, None
            await asyncio.to_thread(client.shutdown)

    def shutdown(self) -> None:
        """Stop the core (synchronous; from a coroutine prefer ``await shutdown_async()``)."""
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        if self.client is not None:
            self.client.shutdown()
            self.client = None

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None or self.client is None or not self.client.is_alive()

    async def check_health(self) -> None:
        if self.client is None:
            raise EngineDeadError("the engine core is not running (not started, or shut down)")
        if self.dead_error is not None or not self.client.is_alive():
            raise EngineDeadError(self.dead_error or "the engine core process is not running; restart the engine")

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | dict | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs of one request, the last with ``finished=True``. Raises ValueError or
        TypeError (naming the field) before anything is sent, EngineDeadError if the core dies meanwhile."""
        await self.check_health()
        # the core only ever sees our own ids: decimal "N" from a counter, children "I_N" (core/parallel.py), so
        # no client id can collide with another request or its children; the client's id is only echoed back
        internal_id = str(next(self._ids))
        request_id = request_id if request_id is not None else f"req-{internal_id}"
        text, ids, params, reqs = self.processor.process(internal_id, prompt, sampling_params)
        state = self.output_processor.add_request(internal_id, text, ids, params, [r.request_id for r in reqs],
                                                  arrival_time=reqs[0].arrival_time, client_id=request_id)
        state.queue = asyncio.Queue()
        finished = False
        try:
            for r in reqs:
                self.client.add_request(r)
            while True:
                out = await state.queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:  # cancelled, closed early or failed: free its slots in the core
                self._abort_state(internal_id)

    def _abort_state(self, internal_id: str) -> None:
        state = self.output_processor.remove(internal_id)
        if state is not None and self.client is not None:
            try:
                self.client.abort_requests([c for c, s in state.children.items() if s.finish_reason is None])
            except EngineDeadError:
                pass

    async def abort(self, request_id: str) -> None:
        """Abort every request in flight that the client named ``request_id`` (client ids need not be unique)."""
        for internal_id, state in list(self.output_processor.requests.items()):
            if state.request_id != request_id:
                continue
            self._abort_state(internal_id)
            if state.queue is not None:
                state.fail(None, FinishReason.ABORT)
                state.queue.put_nowait(state.output())

    # ------------------------------------------------------------------ the output loop
    async def _output_loop(self, client) -> None:
        try:
            while True:
                if isinstance(client, InprocClient):
                    outs = await asyncio.to_thread(client.get_output, 0.1)
                else:
                    outs = await client.get_output_async()
                self._dispatch(outs, client)
                if outs.engine_dead:
                    raise EngineDeadError(client.dead_reason or "the engine core died")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the core is gone: fail every waiter, keep the server up
            self.dead_error = f"{type(e).__name__}: {e}"
            logger.error("engine core lost: %s; %d request(s) in flight end with an error", self.dead_error,
                         len(self.output_processor.requests))
            self._fail_all(f"the engine core died ({self.dead_error}); restart the engine")

    def _dispatch(self, outs: EngineCoreOutputs, client) -> None:
        u = outs.utility_output
        if u is not None and u.call_id in self._utility:
            fut = self._utility.pop(u.call_id)
            if not fut.done():
                if u.failure_message:
                    fut.set_exception(RuntimeError(u.failure_message))
                else:
                    fut.set_result(u.result)
        if outs.scheduler_stats is not None:
            for listener in self.stat_listeners:
                listener(outs.scheduler_stats, outs.outputs)
        if not outs.outputs:
            return
        results, to_abort = self.output_processor.process(outs)
        if to_abort:
            client.abort_requests(to_abort)
        for state, ro in results:
            if state.queue is not None:
                state.queue.put_nowait(ro)

    def _fail_all(self, error: str) -> None:
        for rid in list(self.output_processor.requests):
            state = self.output_processor.remove(rid)
            if state is not None and state.queue is not None:
                state.queue.put_nowait(EngineDeadError(error))
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(error))
        self._utility.clear()

    # ------------------------------------------------------------------ utilities
    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Call an engine-core utility (get_stats, reset_stats, reset, profile, ping) on the request channel."""
        await self.check_health()
        if isinstance(self.client, InprocClient):
            return await asyncio.to_thread(self.client.call_utility, method, *args)
        fut = asyncio.get_running_loop().create_future()
        call_id = self.client.send_utility(method, *args)
        self._utility[call_id] = fut
        return await asyncio.wait_for(fut, timeout)

    async def get_stats(self) -> dict[str, Any]:
        return await self.call_utility("get_stats")

    async def reset(self) -> int:
        return await self.call_utility("reset")

    async def profile(self, num_steps: int = 10) -> str:
        return await self.call_utility("profile", num_steps)

    def num_in_flight(self) -> int:
        return len(self.output_processor.requests)

    @staticmethod
    def now() -> float:
        return time.time()

