"""specdec/sequence_metadata.py: SequenceGroupMetadata's token_chunk_size defaults, apply_delta (and its
refusal of another request's delta), get_all_seq_ids, and finish_step."""

from __future__ import annotations

import pytest

from specdec.datamodel.sequence import SequenceData, SequenceDataDelta, SequenceGroupState, SequenceStage
from specdec.datamodel.metadata import SequenceGroupMetadata, SequenceGroupMetadataDelta, get_all_seq_ids


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
