"""The step loop: admit requests, run one worker step, append emitted tokens, stop, free.

It knows nothing about how tokens are produced (plain or speculative: that is the worker's job) and
nothing about text beyond detokenising finished outputs.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from specdec.engine.matmul import release_threads
from specdec.interfaces import GroupStepOutput, Worker
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.scheduler import Scheduler
from specdec.sequence import (
    ExecuteModelRequest,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceGroupState,
    SequenceStatus,
)

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        worker: Worker,
        tokenizer,
        *,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_id: int | None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.num_speculative_tokens = num_speculative_tokens
        self.scheduler = Scheduler(max_num_seqs)
        self.groups: dict[str, SequenceGroup] = {}  # every request not yet returned to the caller
        self.prompts: dict[str, str | None] = {}
        self.errors: dict[str, str] = {}
        self._finished_since_last_step: list[str] = []
        self._seq_counter = itertools.count()
        self._req_counter = itertools.count()
        self.step_times: list[dict[str, float]] = []  # per decode step: phase -> seconds (incl. 'step')
        self.num_draft_tokens = 0  # draft tokens proposed over all decode steps

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._req_counter))
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use; pass a unique request_id")
        seq = Sequence(next(self._seq_counter), list(prompt_token_ids), eos_token_id=self.eos_token_id)
        group = SequenceGroup(request_id, [seq], time.time(), sampling_params=params,
                              draft_size=self.num_speculative_tokens + 1)
        if params.seed is not None:
            group.state.generator = torch.Generator().manual_seed(params.seed)
        self.groups[request_id] = group
        self.prompts[request_id] = prompt
        n = len(prompt_token_ids)
        # A prompt needs room for at least one generated token inside max_model_len.
        if n == 0 or n >= self.max_model_len:
            why = ("the prompt is empty; pass at least one token" if n == 0 else
                   f"the prompt has {n} tokens but max_model_len={self.max_model_len} leaves no room to "
                   f"generate; raise max_model_len above {n} or shorten the prompt")
            logger.warning("request %s finished without running: %s", request_id, why)
            self._finish(group, SequenceStatus.FINISHED_IGNORED, error=why)
            return request_id
        self.scheduler.add_seq_group(group)
        return request_id

    def abort_request(self, request_id: str) -> None:
        group = self.scheduler.abort_seq_group(request_id)
        if group is not None:
            self._finished_since_last_step.append(request_id)
            self.worker.free_requests([request_id])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- stepping
    def step(self) -> None:
        """Run one scheduler decision: a prefill of newly admitted requests, or a decode step."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return
        t0 = time.perf_counter()
        metas = [self._metadata(g, sched.is_prompt) for g in sched.scheduled]
        req = ExecuteModelRequest(
            seq_group_metadata_list=metas,
            num_lookahead_slots=0 if sched.is_prompt else self.num_speculative_tokens,
            running_queue_size=sched.num_waiting,
            finished_requests_ids=self._finished_since_last_step,
        )
        self._finished_since_last_step = []
        out = self.worker.execute_model(req)
        now = time.time()
        for group, gout in zip(sched.scheduled, out.outputs):
            self._append(group, gout, now, count_step=not sched.is_prompt)
        done = self.scheduler.free_finished()
        if done:
            ids = [g.request_id for g in done]
            self.worker.free_requests(ids)
        if not sched.is_prompt:
            self.step_times.append({**out.times, "step": time.perf_counter() - t0})
        if not self.scheduler.has_unfinished():
            release_threads()  # the engine's decode mode held torch at 1 thread (engine/matmul.py)

    def _metadata(self, group: SequenceGroup, is_prompt: bool) -> SequenceGroupMetadata:
        seq = group.first_seq
        return SequenceGroupMetadata(
            request_id=group.request_id,
            is_prompt=is_prompt,
            seq_data={seq.seq_id: seq.data},
            sampling_params=group.sampling_params,
            block_tables={seq.seq_id: []},
            num_speculative_tokens=None if is_prompt else self.num_speculative_tokens,
            state=group.state,
        )

    def _append(self, group: SequenceGroup, gout: GroupStepOutput, now: float, count_step: bool) -> None:
        seq = group.first_seq
        params: SamplingParams = group.sampling_params
        if gout.error is not None:
            self._finish(group, SequenceStatus.FINISHED_ERROR, error=gout.error)
            return
        self.num_draft_tokens += gout.num_proposed
        if count_step and group.metrics.spec_token_acceptance_counts is not None:
            counts = group.metrics.spec_token_acceptance_counts
            counts[0] += 1  # the target's own token: every decode step
            for i in range(min(gout.num_accepted, len(counts) - 1)):
                counts[i + 1] += 1
        for i, tok in enumerate(gout.token_ids):
            seq.append_token_id(tok, gout.logprobs[i] if gout.logprobs else {})
            if i == 0:
                group.maybe_set_first_token_time(now)
                group.metrics.last_token_time = now
            status = self._stop_status(seq, tok, params)
            if status is not None:
                seq.stop_reason = tok if status == SequenceStatus.FINISHED_STOPPED and tok != self.eos_token_id else None
                self._finish(group, status)
                return

    def _stop_status(self, seq: Sequence, tok: int, params: SamplingParams) -> SequenceStatus | None:
        if not params.ignore_eos and tok == self.eos_token_id:
            return SequenceStatus.FINISHED_STOPPED
        if tok in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, group: SequenceGroup, status: SequenceStatus, error: str | None = None) -> None:
        for seq in group.get_seqs():
            seq.status = status
        group.set_finished_time(time.time())
        if error is not None:
            self.errors[group.request_id] = error

    # ----------------------------------------------------------------- outputs
    def pop_finished(self) -> list[RequestOutput]:
        """Return (and forget) every finished request, as RequestOutputs."""
        done = [rid for rid, g in self.groups.items() if g.is_finished()]
        return [self._output(rid) for rid in done]

    def _output(self, request_id: str) -> RequestOutput:
        group = self.groups.pop(request_id)
        seq = group.first_seq
        toks = list(seq.get_output_token_ids())
        lps = seq.output_logprobs if group.sampling_params.logprobs is not None else None
        cum = seq.data.cumulative_logprob if toks else None
        text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else ""
        comp = CompletionOutput(
            index=0, text=text, token_ids=toks, cumulative_logprob=cum, logprobs=lps,
            finish_reason=SequenceStatus.get_finished_reason(seq.status),
            stop_reason=getattr(seq, "stop_reason", None),
        )
        return RequestOutput(
            request_id=request_id, prompt=self.prompts.pop(request_id, None),
            prompt_token_ids=list(seq.prompt_token_ids), outputs=[comp], finished=True,
            metrics=group.metrics, error=self.errors.pop(request_id, None),
        )
