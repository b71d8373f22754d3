"""specdec.datamodel.sequence: statuses, SequenceData bookkeeping, Sequence and SequenceGroup; with the seed's
methods of these structs that specdec.vllm_compat holds as functions (array_full, computed-token progress, the
delta replayed on a worker's copy, decode timings). SequenceGroupMetadata is in test_sequence_metadata.py; the
wire helpers, model outputs and the vllm.sequence namespace are in test_vllm_compat.py."""

from __future__ import annotations

from array import array

import pytest

from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import (
    VLLM_INVALID_TOKEN_ID, Logprob, Sequence, SequenceData, SequenceDataDelta, SequenceGroup, SequenceGroupState,
    SequenceStage, SequenceStatus,
)
from specdec.vllm_compat import (
    apply_delta, array_full, decode_json, decode_msgpack, encode_json, encode_msgpack, get_delta_and_reset,
    get_last_token_latency, get_num_new_tokens, get_num_uncomputed_tokens, init_multi_step,
    reset_state_for_recompute, set_last_token_time, update_num_computed_tokens,
)


# -- statuses ---------------------------------------------------------------------------------------
FINISH_REASONS = {
    SequenceStatus.WAITING: None,
    SequenceStatus.RUNNING: None,
    SequenceStatus.SWAPPED: None,
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",  # prompt too long: OpenAI says "length"
    SequenceStatus.FINISHED_ERROR: "error",  # NaN/inf logits
}


@pytest.mark.parametrize("status", list(SequenceStatus))
def test_status_finished_and_reason(status: SequenceStatus) -> None:
    assert set(FINISH_REASONS) == set(SequenceStatus)  # a new status must be added to the table
    assert SequenceStatus.get_finished_reason(status) == FINISH_REASONS[status]
    assert SequenceStatus.is_finished(status) == (FINISH_REASONS[status] is not None)


def test_constants_and_array_full() -> None:
    assert VLLM_INVALID_TOKEN_ID == -1
    filled = array_full(VLLM_INVALID_TOKEN_ID, 3)
    assert filled.typecode == "l" and filled.tolist() == [-1, -1, -1]
    assert array_full(7, 0).tolist() == []


# -- SequenceData -----------------------------------------------------------------------------------
def test_sequence_data_append_lengths_and_views() -> None:
    data = SequenceData.from_seqs([1, 2, 3])
    assert data.get_last_token_id() == 3  # no output yet: the last prompt token
    data.append_token_id(4, -0.5)
    data.append_token_id(5, -1.0)
    assert (data.get_len(), data.get_prompt_len(), data.get_output_len()) == (5, 3, 2)
    assert data.get_token_ids() == [1, 2, 3, 4, 5]
    assert data.prompt_token_ids == (1, 2, 3) and data.get_prompt_token_ids() == (1, 2, 3)
    assert data.output_token_ids == [4, 5] and data.get_output_token_ids() == [4, 5]
    assert data.get_last_token_id() == 5
    assert data.cumulative_logprob == pytest.approx(-1.5)
    data.output_token_ids.append(99)  # a copy: the sequence is unchanged
    assert data.get_output_len() == 2


def test_sequence_data_coerces_lists_and_rejects_wrong_typecode() -> None:
    data = SequenceData([1, 2], [3])  # plain lists become array('l')
    assert data.prompt_token_ids_array.typecode == "l" and data.output_token_ids_array.tolist() == [3]
    with pytest.raises(TypeError, match="typecode 'i'"):
        SequenceData(array("i", [1, 2]))


def test_sequence_data_computed_tokens_and_stage() -> None:
    data = SequenceData.from_seqs([1, 2, 3, 4])
    assert data.stage is SequenceStage.PREFILL and get_num_uncomputed_tokens(data) == 4
    update_num_computed_tokens(data, 3)  # a chunk of the prompt: still prefilling
    assert data.stage is SequenceStage.PREFILL and get_num_uncomputed_tokens(data) == 1
    update_num_computed_tokens(data, 1)
    assert data.stage is SequenceStage.DECODE and data.get_num_computed_tokens() == 4
    with pytest.raises(ValueError, match=r"outside \[0, 4\]"):
        update_num_computed_tokens(data, 1)  # more tokens than the sequence has
    data.append_token_id(5, 0.0)
    reset_state_for_recompute(data)  # preempted: prompt and output are recomputed
    assert data.stage is SequenceStage.PREFILL and get_num_uncomputed_tokens(data) == 5
    assert get_delta_and_reset(data).new_output_token_ids == []


def test_delta_replays_the_scheduler_side_on_a_worker_copy() -> None:
    scheduler_side = SequenceData.from_seqs([1, 2, 3])
    worker_side = decode_msgpack(encode_msgpack(scheduler_side), SequenceData)
    update_num_computed_tokens(scheduler_side, 3)
    scheduler_side.append_token_id(7, -0.5)
    scheduler_side.append_token_id(8, -0.25)
    delta = get_delta_and_reset(scheduler_side)
    assert delta == SequenceDataDelta([7, 8], -0.75, 3, SequenceStage.DECODE)
    apply_delta(worker_side, decode_json(encode_json(delta), SequenceDataDelta))
    assert worker_side.get_token_ids() == scheduler_side.get_token_ids() == [1, 2, 3, 7, 8]
    assert worker_side == scheduler_side
    assert get_delta_and_reset(scheduler_side).new_output_token_ids == []  # reset


# -- Sequence / SequenceGroup ----------------------------------------------------------------------
def test_sequence_append_and_status() -> None:
    seq = Sequence(7, [1, 2], eos_token_id=0)
    assert seq.is_prefill() and not seq.is_finished() and seq.status is SequenceStatus.WAITING
    seq.append_token_id(3, {3: Logprob(-0.5), 4: Logprob(-1.5)})
    seq.append_token_id(5, {})  # logprobs not computed: counts 0.0
    assert seq.get_token_ids() == [1, 2, 3, 5] and seq.get_output_token_ids() == [3, 5]
    assert (seq.get_len(), seq.get_prompt_len(), seq.get_output_len()) == (4, 2, 2)
    assert seq.prompt_token_ids == (1, 2) and seq.get_last_token_id() == 5
    assert seq.get_cumulative_logprob() == pytest.approx(-0.5)
    assert len(seq.output_logprobs) == 2
    with pytest.raises(ValueError, match="token 6 is missing"):
        seq.append_token_id(6, {3: Logprob(-0.1)})
    assert seq.get_output_len() == 2  # the failed append left nothing behind
    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    assert seq.is_finished()


@pytest.mark.parametrize("draft_size", [1, 4])
def test_group_starts_one_acceptance_counter_per_position(draft_size: int) -> None:
    group = SequenceGroup("r", [Sequence(0, [1, 2])], arrival_time=10.0, draft_size=draft_size)
    other = SequenceGroup("s", [Sequence(1, [1])], arrival_time=10.0, draft_size=draft_size)
    assert group.metrics.spec_token_acceptance_counts == [0] * draft_size
    group.metrics.spec_token_acceptance_counts[0] += 1
    assert other.metrics.spec_token_acceptance_counts == [0] * draft_size  # not a shared list
    assert group.metrics.arrival_time == group.metrics.last_token_time == 10.0
    assert isinstance(group.state, SequenceGroupState) and group.state.generator is None


def test_group_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="draft_size=0"):
        SequenceGroup("r", [Sequence(0, [1])], 0.0, draft_size=0)
    with pytest.raises(ValueError, match="at least one Sequence"):
        SequenceGroup("r", [], 0.0)


def test_group_timings() -> None:
    seq = Sequence(0, [1, 2])
    group = SequenceGroup("r", [seq], arrival_time=10.0)
    group.maybe_set_first_scheduled_time(12.0)
    group.maybe_set_first_scheduled_time(15.0)  # only the first time counts
    assert group.metrics.first_scheduled_time == 12.0 and group.metrics.time_in_queue == 2.0
    group.maybe_set_first_token_time(13.0)  # no output yet: not a first token
    assert group.metrics.first_token_time is None
    with pytest.raises(ValueError, match="prefill"):
        set_last_token_time(group, 13.0)
    update_num_computed_tokens(group, 2)
    seq.append_token_id(3, {3: Logprob(0.0)})
    group.maybe_set_first_token_time(14.0)
    group.maybe_set_first_token_time(16.0)
    assert group.metrics.first_token_time == 14.0
    set_last_token_time(group, 14.5)
    assert get_last_token_latency(group) == pytest.approx(4.5)  # since arrival_time (last_token_time)
    set_last_token_time(group, 15.0)
    assert get_last_token_latency(group) == pytest.approx(0.5)
    group.set_finished_time(16.0)
    assert group.metrics.finished_time == 16.0


def test_group_seqs_and_finish() -> None:
    a, b = Sequence(0, [1, 2, 3]), Sequence(1, [1, 2, 3])
    group = SequenceGroup("r", [a, b], 0.0, sampling_params=SamplingParams())
    assert group.first_seq is a and group.prompt_token_ids == (1, 2, 3) and group.request_id == "r"
    assert group.num_seqs() == 2 and group.find(1) is b
    with pytest.raises(ValueError, match="no sequence 5"):
        group.find(5)
    a.status = SequenceStatus.RUNNING
    assert group.get_seqs(SequenceStatus.RUNNING) == [a] and group.num_seqs(SequenceStatus.WAITING) == 1
    assert get_num_uncomputed_tokens(group) == 6 and group.is_prefill()
    a.status = SequenceStatus.FINISHED_STOPPED
    assert group.get_finished_seqs() == [a] and not group.is_finished()
    b.status = SequenceStatus.FINISHED_ERROR
    assert group.is_finished() and group.get_unfinished_seqs() == []


def test_sequence_new_tokens_recompute_and_multi_step() -> None:
    seq = Sequence(0, [1, 2, 3])
    assert get_num_new_tokens(seq) == 3  # the whole prompt
    update_num_computed_tokens(seq.data, 3)
    seq.append_token_id(4, {})
    assert get_num_new_tokens(seq) == 1  # decoding: one token a step
    reset_state_for_recompute(seq)  # preempted: the sequence's data starts over
    assert seq.is_prefill() and get_num_new_tokens(seq) == 4
    group = SequenceGroup("r", [seq], 0.0)
    group.state.current_step = 3
    init_multi_step(group, 5)
    assert (group.state.num_steps, group.state.current_step) == (5, 0)
