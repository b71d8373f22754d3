"""specdec.datamodel.metadata: SequenceGroupMetadata's token_chunk_size defaults and get_all_seq_ids; with the
seed's methods specdec.vllm_compat holds as functions: apply_delta (and its refusal of another request's delta
or of a mismatched pair), is_single_step_prompt, finish_step and remaining_steps."""

from __future__ import annotations

import pytest

from specdec.datamodel.sequence import SequenceData, SequenceDataDelta, SequenceGroupState, SequenceStage
from specdec.datamodel.metadata import SequenceGroupMetadata, SequenceGroupMetadataDelta, get_all_seq_ids
from specdec.vllm_compat import apply_delta, finish_step, is_single_step_prompt, remaining_steps


def test_metadata_token_chunk_size_defaults() -> None:
    data = SequenceData.from_seqs([1, 2, 3], [4])
    assert SequenceGroupMetadata("r", True, {0: data}).token_chunk_size == 4  # the whole sequence
    assert SequenceGroupMetadata("r", False, {0: data}).token_chunk_size == 1
    assert SequenceGroupMetadata("r", True, {0: data}, token_chunk_size=2).token_chunk_size == 2


def test_metadata_apply_delta_and_helpers() -> None:
    meta = SequenceGroupMetadata("r", True, {4: SequenceData.from_seqs([1, 2]),
                                             9: SequenceData.from_seqs([1, 2])})
    assert meta.get_first_seq_id() == 4 and is_single_step_prompt(meta)
    decode_meta = SequenceGroupMetadata("s", False, {2: SequenceData.from_seqs([3])})
    assert get_all_seq_ids([meta, decode_meta]) == [4, 9, 2]
    delta = SequenceGroupMetadataDelta({4: SequenceDataDelta([7], -0.5, 2, SequenceStage.DECODE)}, "r",
                                       {4: [3]}, is_prompt=False, token_chunk_size=1)
    apply_delta(meta, delta)
    assert meta.seq_data[4].get_token_ids() == [1, 2, 7] and meta.seq_data[9].get_token_ids() == [1, 2]
    assert (meta.is_prompt, meta.token_chunk_size, meta.block_tables) == (False, 1, {4: [3]})
    assert not is_single_step_prompt(meta)
    with pytest.raises(ValueError, match="'r' was given the delta of request 'x'"):
        apply_delta(meta, SequenceGroupMetadataDelta({}, "x", {}, False))
    with pytest.raises(TypeError, match="SequenceDataDelta on SequenceGroupMetadata"):
        apply_delta(meta, SequenceDataDelta([7], -0.5, 2, SequenceStage.DECODE))


def test_metadata_finish_step() -> None:
    meta = SequenceGroupMetadata("r", False, {0: SequenceData.from_seqs([1])},
                                 state=SequenceGroupState(num_steps=2))
    finish_step(meta)
    finish_step(meta)
    assert meta.state.current_step == 2 and remaining_steps(meta.state) == 0
    with pytest.raises(ValueError, match="no step left"):
        finish_step(meta)
