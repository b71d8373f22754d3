"""The engine core: the step loop (scheduler + worker + speculative stack) behind a message interface.

``EngineCore`` admits :class:`EngineCoreRequest`s, aborts ids, and turns each ``LLMEngine.step()`` into one
:class:`EngineCoreOutputs` (the new token ids per request, finishes, scheduler stats with the step's
speculative counters). ``run_engine_core`` is its busy loop in a spawned process: messages in and outputs out
over the front end's private, authenticated pair of ZeroMQ sockets (channel.py), msgpack both ways; between
steps it drains every pending message, and when idle it blocks on the socket instead of spinning. A message
that fails authentication or decoding is logged and dropped; the core goes on.

It knows nothing about text: the front end tokenizes, detokenizes and matches stop strings (the core's
LLMEngine has no tokenizer). The one exception is guided_decoding: its grammar compiler reads the vocabulary once,
when the core starts, before the tokenizer is dropped. Tensors never leave it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from specdec.core.validate import grammar_compiler
from specdec.entrypoints.engine_args import EngineArgs
from specdec.datamodel.metrics import aggregate_counts, sum_counts
from specdec.v1.channel import CoreChannel
from specdec.v1.protocol import (
    ABORT_DECODER, REQUEST_DECODER, UTILITY_DECODER, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
    EngineCoreRequestType, FinishReason, SchedulerStats, UtilityOutput, encode,
)

logger = logging.getLogger(__name__)

# EngineCore methods a UTILITY message may call
UTILITY_METHODS = ("get_stats", "reset_stats", "reset", "profile", "ping")


class EngineCore:
    def __init__(self, engine_args: EngineArgs, llm=None) -> None:
        self.args = engine_args
        self.llm = llm if llm is not None else engine_args.create_llm()
        self.engine = self.llm.llm_engine
        self._build_grammar_compiler()  # from the tokenizer, which the next line drops
        self.engine.tokenizer = None  # text is the front end's job (see the module docstring)
        self._sent: dict[str, int] = {}  # request id -> output tokens already sent
        self._errors: list[EngineCoreOutput] = []  # requests refused at admission, reported next step
        self._acceptance_counts: list[int] = [0]
        self._chosen_seen: dict[int, int] = {}  # the worker's chosen_counts as last reported (_chosen_since_last)
        self._profile_steps = 0
        self.num_aborted = 0  # requests aborted while unfinished (client gone, stop string, cancel)
        self.num_dropped = 0  # front-end messages that failed to open or decode (logged, dropped)
        self._profiler = None
        # guided requests whose grammar compiles off the step loop (admitted once it is ready): id -> (request, future)
        self._compiling: dict[str, tuple[EngineCoreRequest, Future]] = {}
        self._compile_pool: ThreadPoolExecutor | None = None

    def _build_grammar_compiler(self) -> None:
        """guided_decoding's compiler, built here while the engine still has its tokenizer (a grammar constrains
        text; the compiler reads the vocabulary once, ~0.3 s). A failure is logged and leaves guided requests
        refused (with the engine's reason), never the core down: plain requests do not need it."""
        eng = self.engine
        if eng.tokenizer is None:
            return
        try:
            eng._grammars = grammar_compiler(eng.tokenizer, eng.vocab_size, eng.eos_token_id)
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer xgrammar cannot read
            logger.warning("engine core: no grammar compiler for this tokenizer (%s: %s); requests with "
                           "guided_decoding will be refused", type(e).__name__, e)

    # ----------------------------------------------------------------- requests
    def add_request(self, req: EngineCoreRequest) -> None:
        """Admit ``req``; a guided one once its grammar is compiled. xgrammar's compile time grows steeply with
        the grammar (60,000 choices: ~2 minutes; the 9-byte regex ``.{0,4000}``: ~1.7 s) and releases the GIL, so
        it runs in a thread of its own while the loop steps the others (``admit_compiled``)."""
        compiler = self.engine._grammars
        if req.sampling_params.guided_decoding is not None and compiler is not None:
            if self._compile_pool is None:
                self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            self._compiling[req.request_id] = (req, self._compile_pool.submit(
                compiler.compile, req.sampling_params.guided_decoding))
            return
        self._admit(req)

    @property
    def compiling(self) -> bool:
        """Whether a guided request waits for its grammar (the loop then polls instead of sleeping)."""
        return bool(self._compiling)

    def admit_compiled(self) -> None:
        """Admit the guided requests whose grammar is ready (the engine finds it in the compiler's cache), or
        report the compile's error as theirs."""
        for rid in [rid for rid, (_, fut) in self._compiling.items() if fut.done()]:
            req, fut = self._compiling.pop(rid)
            err = fut.exception()
            if err is None:
                self._admit(req)
            else:
                msg = str(err) if isinstance(err, (TypeError, ValueError)) else f"{type(err).__name__}: {err}"
                self._errors.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=msg))

    def _admit(self, req: EngineCoreRequest) -> None:
        try:
            self.engine.add_request(req.prompt_token_ids, req.sampling_params, request_id=req.request_id,
                                    arrival_time=req.arrival_time)
        except (TypeError, ValueError) as e:  # checked by the front end already; a bug if it gets here
            self._errors.append(EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ERROR, error=str(e)))

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._compiling.pop(rid, None) is not None:  # never admitted; its compile finishes unread
                self.num_aborted += 1
                continue
            group = self.engine.groups.get(rid)
            if group is not None and not group.is_finished():
                self.num_aborted += 1
            self.engine.abort_request(rid)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self._errors) or self.engine.has_finished_outputs()

    # ----------------------------------------------------------------- stepping
    def step(self) -> EngineCoreOutputs:
        eng = self.engine
        if eng.has_unfinished_requests():
            eng.step()
            step_time = eng.last_step_time
        else:
            step_time = 0.0
        if self._profiler is not None:
            self._profile_tick()
        outputs, self._errors = self._errors, []
        updated = eng.pop_updated()
        finished = {o.request_id: o for o in eng.pop_finished()}
        for rid, (n_draft, n_acc) in updated.items():
            if rid in finished:
                continue
            group = eng.groups.get(rid)
            if group is None:
                continue
            seq = group.first_seq
            start, end = self._sent.get(rid, 0), seq.get_output_len()
            if end > start:
                self._sent[rid] = end
                lps = seq.output_logprobs[start:end] if group.sampling_params.wants_logprobs else None
                outputs.append(EngineCoreOutput(rid, seq.data.output_token_ids_array[start:end].tolist(),
                                                new_logprobs=lps, num_draft_tokens=n_draft, num_accepted_tokens=n_acc))
        for rid, out in finished.items():
            comp = out.outputs[0]
            start = self._sent.pop(rid, 0)
            n_draft, n_acc = updated.get(rid, (0, 0))
            if out.metrics is not None and out.metrics.spec_token_acceptance_counts:
                self._acceptance_counts = sum_counts([self._acceptance_counts, out.metrics.spec_token_acceptance_counts])
            outputs.append(EngineCoreOutput(
                rid, comp.token_ids[start:], new_logprobs=comp.logprobs[start:] if comp.logprobs is not None else None,
                finish_reason=FinishReason.from_str(comp.finish_reason), stop_reason=comp.stop_reason,
                num_draft_tokens=n_draft, num_accepted_tokens=n_acc, error=out.error, metrics=out.metrics,
                prompt_logprobs=out.prompt_logprobs))
        st = eng.last_step_stats
        stats = SchedulerStats(
            num_running_reqs=len(eng.scheduler.running), num_waiting_reqs=eng.scheduler.num_waiting,
            step_time=step_time, num_drafts=st.num_drafts, num_draft_tokens=st.num_draft_tokens,
            num_accepted_tokens=st.num_accepted_tokens, num_accepted_tokens_per_pos=list(st.num_accepted_tokens_per_pos),
            num_chosen_per_k=self._chosen_since_last())
        eng.last_step_stats = type(st)()  # counted once
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic(),
                                 finished_requests=list(finished) or None)

    def _chosen_since_last(self) -> list[int]:
        """[K+1] row-steps per chosen k since the last call, from the speculative worker's running tally
        (SpecDecodeWorker.chosen_counts: k -> row-steps); [] when it has none or nothing changed."""
        counts: dict[int, int] = getattr(self.engine.worker, "chosen_counts", None) or {}  # a plain worker has none
        seen = self._chosen_seen
        delta = {k: n - seen.get(k, 0) for k, n in counts.items() if n > seen.get(k, 0)}
        if not delta:
            return []
        self._chosen_seen = dict(counts)
        per_k = [0] * (max(delta) + 1)
        for k, n in delta.items():
            per_k[k] = n
        return per_k

    # ----------------------------------------------------------------- utilities
    def call_utility(self, method: str, args: list[Any]) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(f"EngineCore: no utility {method!r}; the utilities are {', '.join(UTILITY_METHODS)}")
        return getattr(self, method)(*args)

    def ping(self) -> str:
        return "pong"

    def get_stats(self) -> dict[str, Any]:
        """Speculative metrics over the requests finished so far, the step timings and the queue."""
        eng = self.engine
        m = aggregate_counts(self._acceptance_counts, num_draft_tokens=eng.num_draft_tokens,
                             mean_step_time_s=eng.step_stats.means())
        return {"spec_decode": msgspec.to_builtins(m), "num_running_reqs": len(eng.scheduler.running),
                "num_waiting_reqs": eng.scheduler.num_waiting, "speculative": eng.speculative,
                "num_aborted": self.num_aborted,
                "pid": os.getpid()}

    def reset_stats(self) -> None:
        from specdec.datamodel.metrics import StepTimeStats

        self._acceptance_counts = [0]
        self.engine.step_stats = StepTimeStats()
        self.engine.num_draft_tokens = 0

    def reset(self) -> int:
        """Abort every request in the core and reset the statistics; returns how many were aborted."""
        ids = list(self.engine.groups) + list(self._compiling)
        self.abort_requests(ids)
        self.engine.pop_finished()
        self.engine.pop_updated()
        self._sent.clear()
        self.reset_stats()
        return len(ids)

    def profile(self, num_steps: int = 10) -> str:
        """Profile the next ``num_steps`` steps with torch.profiler; the table goes to the core's log (INFO)."""
        import torch.profiler

        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.__enter__()
        self._profile_steps = int(num_steps)
        return f"profiling the next {num_steps} steps; the table is logged by the engine core"

    def _profile_tick(self) -> None:
        self._profile_steps -= 1
        if self._profile_steps <= 0:
            prof, self._profiler = self._profiler, None
            prof.__exit__(None, None, None)
            logger.info("engine core profile:\n%s", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    # ----------------------------------------------------------------- messages
    def handle(self, frames: list[bytes]) -> EngineCoreOutputs | None:
        """Apply one front-end message; a utility call's answer comes back at once. A message that does not
        decode is a protocol error: logged and dropped, the core goes on."""
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames)} frames, not 2 (type tag, payload)")
            kind, payload = EngineCoreRequestType(frames[0]), frames[1]
            decoded = {EngineCoreRequestType.ADD: REQUEST_DECODER, EngineCoreRequestType.ABORT: ABORT_DECODER,
                       EngineCoreRequestType.UTILITY: UTILITY_DECODER}[kind].decode(payload)
        except (ValueError, msgspec.MsgspecError) as e:
            self.num_dropped += 1
            logger.warning("engine core: dropped a malformed message (%s); %d dropped so far", e, self.num_dropped)
            return None
        if kind is EngineCoreRequestType.ADD:
            self.add_request(decoded)
        elif kind is EngineCoreRequestType.ABORT:
            self.abort_requests(decoded)
        else:
            call = decoded
            try:
                out = UtilityOutput(call.call_id, result=self.call_utility(call.method, call.args))
            except Exception as e:  # noqa: BLE001 - the caller gets the failure, the core goes on
                out = UtilityOutput(call.call_id, failure_message=f"{call.method}: {type(e).__name__}: {e}")
            return EngineCoreOutputs(utility_output=out, timestamp=time.monotonic())
        return None


class FrontEndGone(Exception):
    """The process that started this core has exited: nobody will read its outputs."""


READY = -1  # call_id of the message that says the core has loaded its model


def run_engine_core(args: dict[str, Any], input_addr: str, output_addr: str, parent_pid: int, secret_fd: int) -> None:
    """The engine-core process: connect (the channel's secrets come from the inherited pipe ``secret_fd``), load,
    report ready, then loop: drain messages, step, send outputs."""
    import zmq

    logging.basicConfig(level=os.environ.get("SPECDEC_LOG_LEVEL", "INFO"),
                        format="%(asctime)s engine-core %(levelname)s %(message)s")
    channel = CoreChannel(input_addr, output_addr, secret_fd)
    inp, out = channel.input, channel.output
    try:
        core = EngineCore(msgspec.convert(args, EngineArgs))
    except BaseException as e:  # the front end reports it instead of waiting for a ready that never comes
        msg = f"engine core failed to start: {type(e).__name__}: {e}"
        failed = EngineCoreOutputs(utility_output=UtilityOutput(READY, failure_message=msg), engine_dead=True)
        out.send_multipart(channel.to_front.seal([encode(failed)]))
        out.close(linger=2000)
        raise
    ready = EngineCoreOutputs(utility_output=UtilityOutput(READY, result=os.getpid()))
    out.send_multipart(channel.to_front.seal([encode(ready)]))
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)

    def send(msg: EngineCoreOutputs) -> None:
        # never block for good: a front end that died leaves the queue full and nobody reading it
        frames = channel.to_front.seal([encode(msg)])  # sealed once: the HMAC counts messages, not tries
        while True:
            try:
                out.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if os.getppid() != parent_pid:
                    raise FrontEndGone() from None
                time.sleep(0.001)

    try:
        while True:
            # idle: block (1 s at a time, to notice an orphaned core; 5 ms while a grammar compiles); busy: only
            # take what is there
            timeout = 0 if core.has_work() else 5 if core.compiling else 1000
            events = dict(poller.poll(timeout))
            while events.get(inp):
                frames = channel.from_front.open(inp.recv_multipart())
                if frames is None:  # failed the HMAC (CURVE admits only the front end): drop it, go on
                    core.num_dropped += 1
                    logger.warning("engine core: dropped a message that failed authentication")
                    answer = None
                else:
                    answer = core.handle(frames)
                if answer is not None:
                    send(answer)
                events = dict(poller.poll(0))
            core.admit_compiled()
            if core.has_work():
                send(core.step())
            elif os.getppid() != parent_pid:
                raise FrontEndGone()
    except FrontEndGone:
        logger.info("front end (pid %d) is gone; engine core exits", parent_pid)
        return
    except Exception as e:  # a bug escaped the step loop's own containment: tell the front end, then die
        logger.error("engine core died: %s", e, exc_info=e)
        with contextlib.suppress(zmq.Again):  # a front end that is gone reads nothing: do not wait for it
            why = f"engine core died: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            dead = EngineCoreOutputs(engine_dead=True, utility_output=UtilityOutput(READY, failure_message=why))
            out.send_multipart(channel.to_front.seal([encode(dead)]), flags=zmq.NOBLOCK)
        out.close(linger=2000)
        raise


if __name__ == "__main__":  # python -m specdec.v1.core ARGS_JSON INPUT_ADDR OUTPUT_ADDR PARENT_PID SECRET_FD (MPClient)
    import json
    import sys

    run_engine_core(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
