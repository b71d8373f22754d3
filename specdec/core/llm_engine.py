"""The step loop: admit requests, run one worker step, append emitted tokens, stop, free.

It knows nothing about how tokens are produced (plain or speculative: that is the worker's job) and
nothing about text beyond detokenising finished outputs.

Steps are transactions (see transaction.py): a step that raises is rolled back; the requests that make
it fail (found by re-running each alone as a probe) finish with ``finish_reason='error'`` and the others
run the step again, so they produce exactly the tokens they would have without the fault. A
KeyboardInterrupt rolls the step back and propagates: the engine is left as before the step. Memory and
per-step work are bounded: finished requests wait in a queue until ``pop_finished`` hands them back,
step timings are running statistics (``record_step_times=True`` keeps every step's, for experiments).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from specdec.interfaces import GroupStepOutput, StepOutput, Worker
from specdec.datamodel.metrics import SpecStepStats, StepTimeStats, latency_stats, record_acceptance, record_chosen
from specdec.datamodel.outputs import CompletionOutput, RequestOutput
from specdec.datamodel.sampling_params import SamplingParams
from specdec.core.scheduler import Scheduler, SchedulerOutputs
from specdec.core.transaction import StepSnapshot, step_error
from specdec.core.detokenizer import IncrementalDetokenizer
from specdec.core.multi_step import BlockOutputs, row_limits, run_block
from specdec.core.validate import (
    as_sampling_params, check_int, check_stop_token_ids, check_token_fields, check_token_ids, grammar_compiler,
    with_bad_words_tokenized,
)
from specdec.sampling.guided import GrammarCompiler, GrammarState
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.sequence import Sequence, SequenceGroup, SequenceStatus
from specdec.datamodel.metadata import SequenceGroupMetadata

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
        vocab_size: int | None = None,
        record_step_times: bool = False,
        on_idle: Callable[[], None] | None = None,
        score_prompt: Callable[[list[int], int], list] | None = None,
        num_scheduler_steps: int = 1,
    ) -> None:
        """``on_idle`` runs when the last unfinished request is done (the LLM passes the engine's thread
        release there); by default the worker's ``release()`` hook (Worker.release).
        ``num_scheduler_steps`` N > 1: each decode ``step()`` runs up to N worker steps for one scheduler
        decision (multi-step decoding, specdec/core/multi_step.py)."""
        self.num_scheduler_steps = check_int(
            "LLMEngine", "num_scheduler_steps", num_scheduler_steps, 1,
            " (1 = consult the scheduler every step; N > 1 = once per N decode steps)")
        self.worker = worker
        self.on_idle = on_idle if on_idle is not None else worker.release
        self.score_prompt = score_prompt  # (prompt ids, top n) -> prompt logprobs (specdec/core/prompt_logprobs.py)
        self._prompt_logprobs: dict[str, list] = {}  # request id -> its prompt logprobs, until returned
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size  # token ids are checked against it on admission (None: >= 0 only)
        self.scheduler = Scheduler(max_num_seqs)
        self.groups: dict[str, SequenceGroup] = {}  # every request not yet returned to the caller
        self.prompts: dict[str, str | None] = {}
        self.errors: dict[str, str] = {}
        self._finished: list[str] = []  # finished since the last pop_finished, in finishing order
        self._finished_since_last_step: list[str] = []
        self._seq_counter = itertools.count()
        self._req_counter = itertools.count()
        self.step_stats = StepTimeStats()  # per decode step: phase -> seconds (incl. 'step'), running stats
        # every decode step's timings, only when asked for (experiments); None otherwise
        self.step_times: list[dict[str, float]] | None = [] if record_step_times else None
        self.num_draft_tokens = 0  # draft tokens proposed over all decode steps
        # request id -> (draft tokens, accepted) of the requests that emitted tokens since pop_updated()
        self._updated: dict[str, tuple[int, int]] = {}
        self.last_step_stats = SpecStepStats()  # the latest decode step's speculative counters
        self.last_step_time = 0.0  # seconds of the latest step (scheduler + worker)
        # stop strings, matched here when the engine has a tokenizer (the engine core's front end does it
        # otherwise): request id -> its detokenizer
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._emissions: dict[str, list[float]] = {}  # request id -> time.time() of each emitting step
        self._grammars: GrammarCompiler | None = None  # guided_decoding's compiler, built on the first such request

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | dict | None,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Admit one request, or raise (TypeError/ValueError naming the field) having admitted nothing."""
        if request_id is not None:
            if not isinstance(request_id, str):
                raise TypeError(f"LLMEngine: request_id={request_id!r} must be a str (or None for an automatic id)")
            if request_id in self.groups:
                raise ValueError(f"LLMEngine: request_id {request_id!r} is already in use by a request not yet "
                                 "returned; pass a unique request_id, or none for an automatic one")
        token_ids = check_token_ids(prompt_token_ids, self.vocab_size)
        params = as_sampling_params(params)
        check_stop_token_ids(params, self.vocab_size)
        params = with_bad_words_tokenized(params, self.tokenizer)
        check_token_fields(params, self.vocab_size)
        self._check_processors(params)
        if params.prompt_logprobs is not None and self.score_prompt is None:
            raise ValueError("LLMEngine: SamplingParams.prompt_logprobs is set but this engine has no prompt scorer; "
                             "build it through specdec.LLM (which passes one), or drop prompt_logprobs")
        if params.n != 1:
            raise ValueError(f"LLMEngine: SamplingParams.n={params.n}: one request is one sequence here; submit "
                             "n requests (LLM.generate and AsyncLLMEngine do it for you, see specdec/core/parallel.py)")
        if params.min_tokens and self.eos_token_id is not None and not params.ignore_eos:
            params = params.clone()
            params._eos_token_id = self.eos_token_id  # min_tokens masks it too (logits_process.py)
        grammar = None if params.guided_decoding is None else self._grammar(params)  # compiled before admission
        if request_id is None:
            request_id = self._new_request_id()
        seq = Sequence(next(self._seq_counter), token_ids, eos_token_id=self.eos_token_id)
        group = SequenceGroup(request_id, [seq], arrival_time or time.time(), sampling_params=params,
                              draft_size=self.num_speculative_tokens + 1)
        if params.seed is not None:
            group.state.generator = torch.Generator().manual_seed(params.seed)
        group.state.grammar = grammar
        self.groups[request_id] = group
        self.prompts[request_id] = prompt
        n = len(token_ids)
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

    @property
    def speculative(self) -> bool:
        return self.worker.speculative or self.num_speculative_tokens > 0

    def _check_processors(self, params: SamplingParams) -> None:
        """Penalties, biases and masks are applied by the sampler (plain steps) and, under speculation, by
        the worker at every scored position given its drafted prefix (specdec.sampling.sampler.logits_process.process_tree_logits):
        nothing to refuse."""

    def _grammar(self, params: SamplingParams) -> GrammarState:
        """A fresh matcher of the request's grammar, compiled for this vocabulary (the compiler is built once)."""
        if self._grammars is None:
            self._grammars = grammar_compiler(self.tokenizer, self.vocab_size, self.eos_token_id)
        return self._grammars.state(params.guided_decoding)

    def pop_updated(self) -> dict[str, tuple[int, int]]:
        """The requests that emitted tokens (or finished) since the last call -> (draft tokens, accepted)
        of their latest step (num_scheduler_steps > 1: of their latest block). Read their new tokens from
        ``groups[id]`` (or the finished output)."""
        out, self._updated = self._updated, {}
        return out

    def _new_request_id(self) -> str:
        """The next automatic id that no request in flight uses (a user may have chosen "3" already)."""
        while (rid := str(next(self._req_counter))) in self.groups:
            pass
        return rid

    def abort_request(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        was_finished = group is not None and group.is_finished()
        if self.scheduler.abort_seq_group(request_id) is not None:
            if not was_finished:
                self._finished.append(request_id)
            self._finished_since_last_step.append(request_id)
            self.worker.free_requests([request_id])
            if not self.scheduler.has_unfinished() and self.on_idle is not None:
                self.on_idle()  # the last request went by abort: no step will run to notice

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_finished_outputs(self) -> bool:
        """Requests finished (or aborted) that pop_finished() has not handed back yet."""
        return bool(self._finished)

    # ----------------------------------------------------------------- stepping
    def step(self) -> None:
        """Run one scheduler decision: a prefill of newly admitted requests, or a decode step."""
        t_sched = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return
        if sched.is_prompt and self.score_prompt is not None:
            sched.scheduled = self._score_prompts(sched.scheduled)
        t0 = time.perf_counter()
        sched_time = t0 - t_sched
        finished_ids, self._finished_since_last_step = self._finished_since_last_step, []
        last_times = [g.metrics.last_token_time for g in sched.scheduled]
        try:
            try:
                out = self._attempt(sched.scheduled, sched, finished_ids=finished_ids)
            except Exception as exc:  # noqa: BLE001 - any failure of one step is contained to its culprits
                out = self._recover(sched, exc)
        except BaseException:  # KeyboardInterrupt, SystemExit: rolled back already; undo the admission
            if sched.is_prompt:
                self.scheduler.requeue([g for g in sched.scheduled
                                        if not g.is_finished() and g.first_seq.get_output_len() == 0])
            raise
        finally:
            t_free = time.perf_counter()
            done = self.scheduler.free_finished()
            if done:
                self.worker.free_requests([g.request_id for g in done])
            sched_time += time.perf_counter() - t_free
        self.last_step_time = time.perf_counter() - t_sched
        self.last_step_stats = SpecStepStats.of(out.outputs) if out is not None and not sched.is_prompt \
            else SpecStepStats()
        if out is not None:
            self._add_times(sched.scheduled, sched_time, out.times)
        for g, before in zip(sched.scheduled, last_times):
            if g.metrics.last_token_time != before and g.request_id in self.groups:
                self._emissions.setdefault(g.request_id, []).append(g.metrics.last_token_time)
        if out is not None and not sched.is_prompt:
            times = {**out.times, "step": time.perf_counter() - t0}
            self.step_stats.add(times)
            if self.step_times is not None:
                self.step_times.append(times)
        if not self.scheduler.has_unfinished() and self.on_idle is not None:
            self.on_idle()  # e.g. the engine's decode mode held torch at 1 thread (engine/matmul.py)

    def _score_prompts(self, groups: list[SequenceGroup]) -> list[SequenceGroup]:
        """Prompt logprobs of the admitted groups that ask for them (an extra forward each, before their
        prefill: a slot is free for it). A group whose scoring fails finishes with the error."""
        for g in groups:
            n = g.sampling_params.prompt_logprobs
            if n is None or g.request_id in self._prompt_logprobs:
                continue
            try:
                self._prompt_logprobs[g.request_id] = self.score_prompt(list(g.prompt_token_ids), n)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                logger.error("prompt logprobs of request %s failed: %s", g.request_id, e, exc_info=e)
                self._finish(g, SequenceStatus.FINISHED_ERROR,
                             error=f"request {g.request_id}: scoring the prompt for prompt_logprobs failed: "
                                   f"{type(e).__name__}: {e}; retry without prompt_logprobs")
        return [g for g in groups if not g.is_finished()]

    @staticmethod
    def _add_times(groups: list[SequenceGroup], sched_time: float, times: dict[str, float]) -> None:
        """Charge one step's scheduler, forward and execute time to every request in its batch.
        Forward time is the worker's ``forward`` phase, else propose + score (the speculative worker's
        forwards), else the whole execute time (the plain worker does not split sampling out)."""
        execute = times.get("execute", 0.0)
        forward = times.get("forward", times.get("propose", 0.0) + times.get("score", 0.0)) or execute
        for g in groups:
            m = g.metrics
            m.scheduler_time = (m.scheduler_time or 0.0) + sched_time
            m.model_forward_time = (m.model_forward_time or 0.0) + forward
            m.model_execute_time = (m.model_execute_time or 0.0) + execute

    def _attempt(self, groups: list[SequenceGroup], sched: SchedulerOutputs, *, probe: bool = False,
                 finished_ids: list[str] | None = None) -> StepOutput:
        """One worker step over ``groups`` (a decode with num_scheduler_steps N > 1: a block of up to N) as a
        transaction: committed if it returns, rolled back if it raises (anything, KeyboardInterrupt included).
        A probe is always rolled back. The returned StepOutput holds every step's outputs, times summed."""
        metas = [self._metadata(g, sched.is_prompt) for g in groups]
        req = ExecuteModelRequest(
            seq_group_metadata_list=metas,
            num_lookahead_slots=0 if sched.is_prompt else self.num_speculative_tokens,
            running_queue_size=len(self.scheduler.running),  # vLLM's: the requests running (disable_by_batch_size)
            num_waiting=sched.num_waiting,
            finished_requests_ids=finished_ids or [],
        )
        snap = StepSnapshot(self.worker, groups, metas)
        counters = self.num_draft_tokens, len(self._finished)
        try:
            t_exec = time.perf_counter()
            per, times = self._execute(req, groups, 1 if sched.is_prompt else self.num_scheduler_steps)
            times["execute"] = time.perf_counter() - t_exec
            if not probe:  # pythonize: replay each group's outputs through the ordinary append, in order
                now = time.time()
                for group, gouts in zip(groups, per):
                    drafted = accepted = 0
                    for gout in gouts:
                        if group.is_finished():  # a stop string ended it earlier in the block: drop the rest
                            break
                        self._append(group, gout, now, count_step=not sched.is_prompt)
                        drafted, accepted = drafted + gout.num_proposed, accepted + gout.num_accepted
                    if len(gouts) > 1 and group.request_id in self._updated:  # the block's counts, not its last step's
                        self._updated[group.request_id] = (drafted, accepted)
        except BaseException:
            self._rollback(snap, counters, groups)
            raise
        if probe:
            self._rollback(snap, counters, groups)
        return StepOutput([gout for gouts in per for gout in gouts], times)

    def _execute(self, req: ExecuteModelRequest, groups: list[SequenceGroup], num_steps: int,
                 ) -> tuple[BlockOutputs, dict[str, float]]:
        """([B] each group's step outputs, phase times) of one step, or of a block of up to ``num_steps``:
        the worker's own fast loop where it has one and it applies, else ``execute_model`` per step."""
        if num_steps == 1:
            out = self.worker.execute_model(req)
            if len(out.outputs) != len(groups):
                raise RuntimeError(f"{type(self.worker).__name__}.execute_model returned {len(out.outputs)} "
                                   f"outputs for {len(groups)} sequence groups; it must return one per group")
            return [[gout] for gout in out.outputs], dict(out.times)
        if req.finished_requests_ids:  # what execute_model would have freed first
            self.worker.free_requests(req.finished_requests_ids)
            req.finished_requests_ids = []
        # the worker's own fast loop (Worker.decode_steps; None where it has none or it does not apply)
        done = self.worker.decode_steps(req.seq_group_metadata_list, num_steps,
                                        [row_limits(g, self.eos_token_id, self.max_model_len) for g in groups])
        if done is not None:
            return done
        times: dict[str, float] = {}
        return run_block(self.worker, req, groups, num_steps, self._advance, times), times

    def _advance(self, group: SequenceGroup, gout: GroupStepOutput) -> bool:
        """Inside a block: append a step's tokens to the sequence (the next step's input); True when one of
        them ends it by id or length (stop strings wait for the replay: they need the detokenizer)."""
        seq, params = group.first_seq, group.sampling_params
        for i, tok in enumerate(gout.token_ids):
            seq.append_token_id(tok, gout.logprobs[i] if gout.logprobs else {})
            if self._stop_status(seq, tok, params) is not None:
                return True
        return False

    def _rollback(self, snap: StepSnapshot, counters: tuple[int, int], groups: list[SequenceGroup]) -> None:
        snap.restore()
        self.num_draft_tokens = counters[0]
        del self._finished[counters[1]:]
        for g in groups:
            self._updated.pop(g.request_id, None)
            self._detok.pop(g.request_id, None)  # rebuilt from the restored tokens when next needed
            if not g.is_finished():
                self.errors.pop(g.request_id, None)

    def _recover(self, sched: SchedulerOutputs, exc: Exception) -> StepOutput | None:
        """The step raised and was rolled back. Find the requests that make it raise (each one re-run
        alone, as a probe that is rolled back too), finish them with an error, and run the step again
        for the others. Returns that step's output, or None when no request is left to run."""
        groups = sched.scheduled
        logger.error("a %s step over %d request(s) raised %s: %s; rolled back, isolating the cause",
                     "prefill" if sched.is_prompt else "decode", len(groups), type(exc).__name__, exc,
                     exc_info=exc)
        culprits: dict[str, BaseException] = {}
        if len(groups) == 1:
            culprits[groups[0].request_id] = exc
        else:
            for g in groups:
                try:
                    self._attempt([g], sched, probe=True)
                except Exception as e:  # noqa: BLE001
                    culprits[g.request_id] = e
        for g in groups:
            if g.request_id in culprits:
                self._finish(g, SequenceStatus.FINISHED_ERROR,
                             error=step_error(g.request_id, culprits[g.request_id], isolated=True))
        rest = [g for g in groups if g.request_id not in culprits]
        if not rest:
            return None
        try:
            return self._attempt(rest, sched)
        except Exception as again:  # noqa: BLE001 - not one request's fault: stop the step's, keep the engine
            logger.error("the step failed again without its culprits (%s); stopping its %d request(s)",
                         again, len(rest), exc_info=again)
            for g in rest:
                self._finish(g, SequenceStatus.FINISHED_ERROR, error=step_error(g.request_id, again, isolated=False))
            return None

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
        self._updated[group.request_id] = (gout.num_proposed, gout.num_accepted)
        if count_step and group.metrics.spec_token_acceptance_counts is not None:
            record_acceptance(group.metrics.spec_token_acceptance_counts, gout.num_accepted)
            record_chosen(group.metrics, gout.num_proposed, gout.num_chosen)
        for i, tok in enumerate(gout.token_ids):
            seq.append_token_id(tok, gout.logprobs[i] if gout.logprobs else {})
            if i == 0:
                group.maybe_set_first_token_time(now)
                group.metrics.last_token_time = now
            status = self._stop_status(seq, tok, params)
            if status is None and params.stop and self.tokenizer is not None and self._stop_string(group, tok):
                status = SequenceStatus.FINISHED_STOPPED
            if status is not None:
                if not isinstance(seq.stop_reason, str):  # a stop string set it already
                    seq.stop_reason = tok if status == SequenceStatus.FINISHED_STOPPED and tok != self.eos_token_id else None
                self._finish(group, status)
                return

    def _stop_string(self, group: SequenceGroup, tok: int) -> bool:
        """Feed ``tok`` (just appended) to the request's detokenizer; True when a stop string matched."""
        seq, params = group.first_seq, group.sampling_params
        det = self._detok.get(group.request_id)
        if det is None:
            det = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                         params.include_stop_str_in_output)
            det.add(seq.get_output_token_ids()[:-1])
            self._detok[group.request_id] = det
        matched = det.add([tok])
        if matched is not None:
            seq.stop_reason = matched
        return matched is not None

    def _stop_status(self, seq: Sequence, tok: int, params: SamplingParams) -> SequenceStatus | None:
        if seq.get_output_len() > params.min_tokens:  # min_tokens: no EOS/stop id counts before then
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
        self._finished.append(group.request_id)
        self._updated.setdefault(group.request_id, (0, 0))

    # ----------------------------------------------------------------- outputs
    def pop_finished(self) -> list[RequestOutput]:
        """Return (and forget) every request finished since the last call, as RequestOutputs: O(finished),
        whatever the queue length."""
        done, self._finished = self._finished, []
        for rid in done:  # bounded: a caller that never reads pop_updated() keeps only running requests there
            self._updated.pop(rid, None)
        return [self._output(rid) for rid in dict.fromkeys(done) if rid in self.groups]

    def _output(self, request_id: str) -> RequestOutput:
        group = self.groups.pop(request_id)
        seq = group.first_seq
        toks = list(seq.get_output_token_ids())
        lps = seq.output_logprobs if group.sampling_params.wants_logprobs else None
        cum = seq.data.cumulative_logprob if toks else None
        det = self._detok.pop(request_id, None)
        skip = group.sampling_params.skip_special_tokens
        if det is not None and det.stop_reason is not None:
            text = det.text  # cut at the stop string
        else:
            text = self.tokenizer.decode(toks, skip_special_tokens=skip) if self.tokenizer is not None else ""
        comp = CompletionOutput(
            index=0, text=text, token_ids=toks, cumulative_logprob=cum, logprobs=lps,
            finish_reason=SequenceStatus.get_finished_reason(seq.status),
            stop_reason=seq.stop_reason,
        )
        emissions = self._emissions.pop(request_id, [])
        return RequestOutput(
            request_id=request_id, prompt=self.prompts.pop(request_id, None),
            prompt_token_ids=list(seq.prompt_token_ids), outputs=[comp], finished=True,
            metrics=group.metrics, error=self.errors.pop(request_id, None),
            latency=latency_stats(group.metrics, len(toks), emissions),
            prompt_logprobs=self._prompt_logprobs.pop(request_id, None),
        )
