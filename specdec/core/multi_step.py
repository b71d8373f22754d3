"""Multi-step decoding (``num_scheduler_steps = N``, after the seed's vllm.worker.multi_step_model_runner).

One scheduler decision, then up to N decode steps over the same batch before the scheduler is asked again:

- inputs advance in place: the step's SequenceGroupMetadata hold the live SequenceData, so a step that
  appends a token is the next step's input (no metadata rebuilt); the plain worker's fast loop
  (PlainWorker.decode_steps) goes further and feeds its sampled token tensor straight back, touching no
  Python object per row until the block ends; the speculative worker's (SpecDecodeWorker.decode_steps, greedy
  chains) verifies on tensors and builds its outputs once per block, each step still k+1 tokens per row;
- a row leaves the block at once when a cheap check ends it (EOS, a stop token id, max_tokens,
  max_model_len, an error), so it never runs past its stopping token nor past its KV capacity;
- pythonization is deferred: each row's step outputs are kept and replayed through the engine's ordinary
  append (stop strings, logprobs, metrics, first-token time) once per block. A stop string found there
  ends the request at the right token; the tokens it made after it are dropped and its KV slot and draft
  state are freed with it, so nothing leaks and its neighbours (batch-invariant engines) are unaffected;
- streaming still sees every token, in bursts of up to N (times k+1 under speculation) per block.

Prefill steps are never multi-stepped. The block is one transaction (core/transaction.py): if any of its
steps raises, all of them are rolled back. This module knows nothing about how a step is computed
(plain or speculative) nor about text: stop strings are the engine's replay's job.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import SequenceGroup
from specdec.interfaces import GroupStepOutput, Worker

BlockOutputs = list[list[GroupStepOutput]]  # [B] per group, its step outputs in order (1 .. N)


def row_limits(group: SequenceGroup, eos_token_id: int | None, max_model_len: int,
               ) -> tuple[int, frozenset[int]] | None:
    """(tokens the row may still emit, token ids that end it) for a worker's fast loop, or None when a stop
    rule needs more than ids and a count (min_tokens not reached yet: EOS does not count before it)."""
    params: SamplingParams = group.sampling_params
    seq = group.first_seq
    if seq.get_output_len() < params.min_tokens:
        return None
    budget = min(params.max_tokens - seq.get_output_len(), max_model_len - seq.get_len())
    stops = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stops.add(eos_token_id)
    return max(budget, 0), frozenset(stops)


def run_block(worker: Worker, req: ExecuteModelRequest, groups: list[SequenceGroup], num_steps: int,
              advance: Callable[[SequenceGroup, GroupStepOutput], bool], times: dict[str, float]) -> BlockOutputs:
    """Up to ``num_steps`` ``worker.execute_model`` calls over ``groups`` (the generic loop: any worker).

    ``advance(group, out)`` appends a step's tokens to the group's sequence (the next step's input) and says
    whether a cheap check ended it; such a row (or one with an error) leaves the batch. The sequences are put
    back as they were before the block when it returns: the caller replays the outputs. ``times`` sums the
    steps' phase timings."""
    metas = list(req.seq_group_metadata_list)
    checkpoints = [g.first_seq.checkpoint() for g in groups]
    per: BlockOutputs = [[] for _ in groups]
    live = list(range(len(groups)))
    try:
        for i in range(num_steps):
            out = worker.execute_model(req)
            if len(out.outputs) != len(live):
                raise RuntimeError(f"{type(worker).__name__}.execute_model returned {len(out.outputs)} outputs for "
                                   f"{len(live)} sequence groups; it must return one per group")
            for name, sec in out.times.items():
                times[name] = times.get(name, 0.0) + sec
            keep = []
            for b, gout in zip(live, out.outputs):
                per[b].append(gout)
                if gout.error is None and not advance(groups[b], gout):
                    keep.append(b)
            if not keep or i == num_steps - 1:
                break
            if len(keep) < len(live) or req.finished_requests_ids:  # freed by the first step already
                live = keep  # the same metadata objects: their SequenceData advanced in place
                req = ExecuteModelRequest(seq_group_metadata_list=[metas[b] for b in live],
                                          num_lookahead_slots=req.num_lookahead_slots,
                                          running_queue_size=req.running_queue_size, num_waiting=req.num_waiting)
    finally:
        for g, cp in zip(groups, checkpoints):
            g.first_seq.restore(cp)
    return per
