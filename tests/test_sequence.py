"""specdec.sequence (+ sequence_metadata): statuses, SequenceData bookkeeping, groups, wire round-trips."""

from __future__ import annotations

from array import array

import msgspec
import pytest
import torch

import specdec.hidden_states
from specdec.sampling_params import SamplingParams
from specdec.sequence import (
    VLLM_INVALID_TOKEN_ID, VLLM_TOKEN_ID_ARRAY_TYPE, Logprob, RequestMetrics, Sequence, SequenceData, SequenceDataDelta,
    SequenceGroup, SequenceGroupState, SequenceStage, SequenceStatus, array_full,
)
from specdec.sequence_metadata import SequenceGroupMetadata, SequenceGroupMetadataDelta, get_all_seq_ids
from specdec.vllm_compat import (
    CompletionSequenceGroupOutput, SequenceOutput, decode_json, decode_msgpack, encode_json, encode_msgpack,
)

CODECS = {"msgpack": (encode_msgpack, decode_msgpack), "json": (encode_json, decode_json)}


def _busy_seq_data() -> SequenceData:
    """A SequenceData with every field away from its default."""
    data = SequenceData.from_seqs([5, 6, 7], [8])
    data.update_num_computed_tokens(4)  # all 4 tokens computed -> DECODE
    data.append_token_id(9, -0.25)  # leaves a pending delta
    return data


def _examples() -> dict[str, object]:
    logprobs = {9: Logprob(-0.25, rank=1, decoded_token="hi"), 3: Logprob(-2.0)}
    return {
        "Logprob": Logprob(-1.5, rank=2, decoded_token=" the"),
        "Logprob-defaults": Logprob(0.0),
        "SequenceData": _busy_seq_data(),
        "SequenceData-empty-output": SequenceData.from_seqs([1]),
        "SequenceDataDelta": SequenceDataDelta([4, 5], -3.5, 7, SequenceStage.DECODE),
        "RequestMetrics": RequestMetrics(1.0, 2.0, first_scheduled_time=1.5, first_token_time=1.75,
                                         time_in_queue=0.5, spec_token_acceptance_counts=[10, 8, 4, 2]),
        "SequenceGroupState": SequenceGroupState(num_steps=4, current_step=2),
        "SequenceGroupMetadata": SequenceGroupMetadata(
            "req-0", True, {3: _busy_seq_data()}, SamplingParams(temperature=0.7, seed=11),
            block_tables={3: [0, 1]}, num_speculative_tokens=4),
        "SequenceGroupMetadataDelta": SequenceGroupMetadataDelta(
            {3: SequenceDataDelta([1], -0.5, 5, SequenceStage.DECODE)}, "req-0", {3: [2]}, False,
            token_chunk_size=1),
        "SequenceOutput": SequenceOutput(3, 9, logprobs),
        "CompletionSequenceGroupOutput": CompletionSequenceGroupOutput(
            [SequenceOutput(3, 9, logprobs)], [None, {6: Logprob(-0.1)}]),
    }


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", list(_examples()))
def test_tensor_free_structs_round_trip(name: str, codec: str) -> None:
    encode, decode = CODECS[codec]
    original = _examples()[name]
    decoded = decode(encode(original), type(original))
    assert type(decoded) is type(original)
    assert decoded == original
    assert encode(decoded) == encode(original)  # nothing lost or re-defaulted on the way


@pytest.mark.parametrize("codec", CODECS)
def test_decoded_sequence_data_is_live(codec: str) -> None:
    encode, decode = CODECS[codec]
    decoded = decode(encode(_busy_seq_data()), SequenceData)
    assert decoded.prompt_token_ids_array.typecode == VLLM_TOKEN_ID_ARRAY_TYPE
    assert isinstance(decoded.output_token_ids_array, array)
    assert decoded.stage is SequenceStage.DECODE
    decoded.append_token_id(10, -1.0)  # arrays came back as arrays, not lists: appending works
    assert decoded.get_token_ids() == [5, 6, 7, 8, 9, 10]
    assert decoded.cumulative_logprob == pytest.approx(-1.25)
    assert decoded.get_delta_and_reset().new_output_token_ids == [9, 10]


@pytest.mark.parametrize("codec", CODECS)
def test_mixed_metadata_list_decodes_by_tag(codec: str) -> None:
    encode, decode = CODECS[codec]
    examples = _examples()
    batch = [examples["SequenceGroupMetadataDelta"], examples["SequenceGroupMetadata"]]
    decoded = decode(encode(batch), list[SequenceGroupMetadata | SequenceGroupMetadataDelta])
    assert [type(x) for x in decoded] == [SequenceGroupMetadataDelta, SequenceGroupMetadata]
    assert decoded == batch
    assert decoded[1].sampling_params == SamplingParams(temperature=0.7, seed=11)


def test_bad_token_ids_and_tensors_are_refused_on_the_wire() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_json(b'{"prompt_token_ids": [1, "two"]}', SequenceData)
    with pytest.raises(TypeError, match="generator"):
        encode_msgpack(SequenceGroupState(generator=torch.Generator().manual_seed(0)))


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
    assert data.stage is SequenceStage.PREFILL and data.get_num_uncomputed_tokens() == 4
    data.update_num_computed_tokens(3)  # a chunk of the prompt: still prefilling
    assert data.stage is SequenceStage.PREFILL and data.get_num_uncomputed_tokens() == 1
    data.update_num_computed_tokens(1)
    assert data.stage is SequenceStage.DECODE and data.get_num_computed_tokens() == 4
    with pytest.raises(ValueError, match=r"outside \[0, 4\]"):
        data.update_num_computed_tokens(1)  # more tokens than the sequence has
    data.append_token_id(5, 0.0)
    data.reset_state_for_recompute()  # preempted: prompt and output are recomputed
    assert data.stage is SequenceStage.PREFILL and data.get_num_uncomputed_tokens() == 5
    assert data.get_delta_and_reset().new_output_token_ids == []


def test_delta_replays_the_scheduler_side_on_a_worker_copy() -> None:
    scheduler_side = SequenceData.from_seqs([1, 2, 3])
    worker_side = decode_msgpack(encode_msgpack(scheduler_side), SequenceData)
    scheduler_side.update_num_computed_tokens(3)
    scheduler_side.append_token_id(7, -0.5)
    scheduler_side.append_token_id(8, -0.25)
    delta = scheduler_side.get_delta_and_reset()
    assert delta == SequenceDataDelta([7, 8], -0.75, 3, SequenceStage.DECODE)
    worker_side.apply_delta(decode_json(encode_json(delta), SequenceDataDelta))
    assert worker_side.get_token_ids() == scheduler_side.get_token_ids() == [1, 2, 3, 7, 8]
    assert worker_side == scheduler_side
    assert scheduler_side.get_delta_and_reset().new_output_token_ids == []  # reset


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
        group.set_last_token_time(13.0)
    group.update_num_computed_tokens(2)
    seq.append_token_id(3, {3: Logprob(0.0)})
    group.maybe_set_first_token_time(14.0)
    group.maybe_set_first_token_time(16.0)
    assert group.metrics.first_token_time == 14.0
    group.set_last_token_time(14.5)
    assert group.get_last_token_latency() == pytest.approx(4.5)  # since arrival_time (last_token_time)
    group.set_last_token_time(15.0)
    assert group.get_last_token_latency() == pytest.approx(0.5)
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
    assert group.get_num_uncomputed_tokens() == 6 and group.is_prefill()
    a.status = SequenceStatus.FINISHED_STOPPED
    assert group.get_finished_seqs() == [a] and not group.is_finished()
    b.status = SequenceStatus.FINISHED_ERROR
    assert group.is_finished() and group.get_unfinished_seqs() == []


# -- metadata and outputs --------------------------------------------------------------------------
def test_metadata_token_chunk_size_defaults() -> None:
    data = SequenceData.from_seqs([1, 2, 3], [4])
    assert SequenceGroupMetadata("r", True, {0: data}).token_chunk_size == 4  # the whole sequence
    assert SequenceGroupMetadata("r", False, {0: data}).token_chunk_size == 1
    assert SequenceGroupMetadata("r", True, {0: data}, token_chunk_size=2).token_chunk_size == 2


def test_metadata_apply_delta_and_helpers() -> None:
    meta = SequenceGroupMetadata("r", True, {4: SequenceData.from_seqs([1, 2]),
                                             9: SequenceData.from_seqs([1, 2])})
    assert meta.get_first_seq_id() == 4 and meta.is_single_step_prompt
    decode_meta = SequenceGroupMetadata("s", False, {2: SequenceData.from_seqs([3])})
    assert get_all_seq_ids([meta, decode_meta]) == [4, 9, 2]
    delta = SequenceGroupMetadataDelta({4: SequenceDataDelta([7], -0.5, 2, SequenceStage.DECODE)}, "r",
                                       {4: [3]}, is_prompt=False, token_chunk_size=1)
    meta.apply_delta(delta)
    assert meta.seq_data[4].get_token_ids() == [1, 2, 7] and meta.seq_data[9].get_token_ids() == [1, 2]
    assert (meta.is_prompt, meta.token_chunk_size, meta.block_tables) == (False, 1, {4: [3]})
    assert not meta.is_single_step_prompt
    with pytest.raises(ValueError, match="'r' was given the delta of request 'x'"):
        meta.apply_delta(SequenceGroupMetadataDelta({}, "x", {}, False))


def test_metadata_finish_step() -> None:
    meta = SequenceGroupMetadata("r", False, {0: SequenceData.from_seqs([1])},
                                 state=SequenceGroupState(num_steps=2))
    meta.finish_step()
    meta.finish_step()
    assert meta.state.current_step == 2 and meta.state.remaining_steps == 0
    with pytest.raises(ValueError, match="no step left"):
        meta.finish_step()


def test_output_equality() -> None:
    out = SequenceOutput(0, 5, {5: Logprob(-0.5)})
    assert out == SequenceOutput(0, 5, {5: Logprob(-0.5)})
    assert out != SequenceOutput(0, 5, {5: Logprob(-0.25)})
    assert out != SequenceOutput(1, 5, {5: Logprob(-0.5)})
    assert out.__eq__("not an output") is NotImplemented and out != "not an output"
    group_out = CompletionSequenceGroupOutput([out], None)
    assert group_out == CompletionSequenceGroupOutput([SequenceOutput(0, 5, {5: Logprob(-0.5)})], None)
    assert group_out != CompletionSequenceGroupOutput([out], [None])
    assert group_out.__eq__(out) is NotImplemented


def test_vllm_compat_has_every_name_of_the_data_model_and_no_module_imports_a_later_one() -> None:
    """vllm.sequence's names in one namespace; the layers import only the ones above them (no circle)."""
    import ast
    import inspect

    import specdec.sequence as sequence
    import specdec.sequence_metadata as metadata
    import specdec.vllm_compat as compat

    assert compat.HiddenStates is specdec.hidden_states.HiddenStates
    assert compat.ExecuteModelRequest is specdec.hidden_states.ExecuteModelRequest
    assert all(hasattr(compat, n) for n in compat.__all__)
    layers = ["specdec.sequence", "specdec.sequence_metadata", "specdec.hidden_states", "specdec.vllm_compat"]
    for i, mod in enumerate((sequence, metadata, specdec.hidden_states, compat)):
        imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(mod))) if isinstance(n, ast.ImportFrom)}
        assert not imported & set(layers[i:]), f"{mod.__name__} imports a module at or below its own layer"
