"""The front end's output side: EngineCoreOutputs -> RequestOutputs, per request, in step order.

Per child sequence: the tokens so far, the incremental detokenizer (stop strings matched here: the
child is then finished and its id returned for an abort in the core), logprobs, and the time each
step's tokens arrived (for ITL). A parent with n children gets one RequestOutput carrying all of them,
finished when every child is. Outputs are cumulative; their ``text`` holds only text that can no longer
change (a possible stop string's start is held back until the request finishes).

Requests are keyed by the front end's internal ids (unique by construction, the only ids the core sees);
the client's id rides along in ``RequestState.request_id`` to be echoed in the outputs, and may repeat.
Knows nothing about transport: the caller feeds it outputs and drains ``RequestState.queue``.
"""

from __future__ import annotations

import asyncio
import time

from specdec.datamodel.metrics import latency_stats
from specdec.datamodel.outputs import CompletionOutput, RequestOutput
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Logprob, RequestMetrics
from specdec.core.detokenizer import IncrementalDetokenizer
from specdec.v1.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason


class ChildState:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop,
                                            params.include_stop_str_in_output)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.wants_logprobs else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.metrics: RequestMetrics | None = None
        self.emissions: list[float] = []  # time.time() when each step's tokens arrived
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.prompt_logprobs: list | None = None


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 child_ids: list[str], tokenizer, arrival_time: float, client_id: str | None = None) -> None:
        self.internal_id = request_id  # the front end's own, unique: the core's name for it (and child_ids)
        self.request_id = request_id if client_id is None else client_id  # the client's, echoed in outputs
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.child_ids = child_ids
        self.children = {cid: ChildState(tokenizer, params) for cid in child_ids}
        self.tokenizer = tokenizer
        self.arrival_time = arrival_time
        self.queue: asyncio.Queue | None = None  # the consumer's, set by AsyncLLMEngine
        self.final_text: dict[str, str] = {}

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())

    def update(self, out: EngineCoreOutput, now: float) -> bool:
        """Apply one core output to its child; True when a stop string just finished it (abort it in the core)."""
        child = self.children[out.request_id]
        if child.finish_reason is not None:  # stopped by a stop string already: the rest is moot
            return False
        if out.new_token_ids:
            child.emissions.append(now)
        n_before = len(child.detok.token_ids)
        stopped = child.detok.add(out.new_token_ids) is not None
        if child.logprobs is not None and out.new_logprobs:
            child.logprobs.extend(out.new_logprobs[:len(child.detok.token_ids) - n_before])
        child.num_draft_tokens += out.num_draft_tokens
        child.num_accepted_tokens += out.num_accepted_tokens
        if out.metrics is not None:
            child.metrics = out.metrics
        if out.prompt_logprobs is not None:
            child.prompt_logprobs = out.prompt_logprobs
        if stopped:
            child.finish_reason, child.stop_reason = FinishReason.STOP, child.detok.stop_reason
            if child.metrics is None:
                child.metrics = RequestMetrics(arrival_time=self.arrival_time, last_token_time=now,
                                               first_token_time=child.emissions[0] if child.emissions else None,
                                               finished_time=now)
            return not out.finished
        if out.finished:
            child.finish_reason, child.stop_reason, child.error = out.finish_reason, out.stop_reason, out.error
        return False

    def fail(self, error: str | None, reason: FinishReason = FinishReason.ERROR) -> None:
        """Every unfinished child ends now (the core is gone, or the request was aborted)."""
        for child in self.children.values():
            if child.finish_reason is None:
                child.finish_reason, child.error = reason, error

    def output(self) -> RequestOutput:
        comps = []
        for i, cid in enumerate(self.child_ids):
            c = self.children[cid]
            done = c.finish_reason is not None
            if done and c.detok.stop_reason is None:
                # the whole output decoded at once, exactly as LLM.generate words it
                text = self.tokenizer.decode(c.detok.token_ids, skip_special_tokens=self.params.skip_special_tokens)
            elif done:
                text = c.detok.text
            else:
                c.detok.stream_delta(False)
                text = c.detok.text[:c.detok.streamed]
            comps.append(CompletionOutput(
                index=i, text=text, token_ids=list(c.detok.token_ids), logprobs=c.logprobs,
                cumulative_logprob=(sum(d[t].logprob for d, t in zip(c.logprobs, c.detok.token_ids))
                                    if c.logprobs else None),
                finish_reason=None if c.finish_reason is None else str(c.finish_reason), stop_reason=c.stop_reason))
        first = self.children[self.child_ids[0]]
        finished = self.finished
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids, outputs=comps,
            finished=finished, metrics=first.metrics,
            error=next((c.error for c in self.children.values() if c.error), None),
            latency=latency_stats(first.metrics, len(first.detok.token_ids), first.emissions) if finished else None,
            prompt_logprobs=first.prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # internal parent id -> state
        self.parent_of: dict[str, str] = {}  # internal child id -> internal parent id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    child_ids: list[str], arrival_time: float | None = None,
                    client_id: str | None = None) -> RequestState:
        """Track ``request_id`` (the front end's internal id, unique) and its ``child_ids`` (the ids the core
        reports); its outputs carry ``client_id`` when given (that one need not be unique)."""
        taken = [i for i in [request_id, *child_ids] if i in self.requests or i in self.parent_of]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use by a running request or one of its "
                             "children; internal ids must be unique (AsyncLLMEngine assigns them)")
        state = RequestState(request_id, prompt, prompt_token_ids, params, child_ids, self.tokenizer,
                             arrival_time or time.time(), client_id)
        self.requests[request_id] = state
        for cid in child_ids:
            self.parent_of[cid] = request_id
        return state

    def remove(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for cid in state.child_ids:
                self.parent_of.pop(cid, None)
        return state

    def process(self, outs: EngineCoreOutputs) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """([(state, its new RequestOutput)], child ids to abort in the core: stop strings matched)."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outs.outputs:
            parent = self.parent_of.get(out.request_id)
            if parent is None:
                continue  # aborted by the front end meanwhile
            state = self.requests[parent]
            if state.update(out, now):
                to_abort.append(out.request_id)
            touched[parent] = state
        results = []
        for rid, state in touched.items():
            results.append((state, state.output()))
            if state.finished:
                self.remove(rid)
        return results, to_abort
