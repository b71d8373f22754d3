"""Per-step metadata of the data model (after ``vllm.sequence``): what the scheduler hands the worker.

``SequenceGroupMetadata`` is what the worker gets for one request each step (the full thing the first
time, a ``SequenceGroupMetadataDelta`` after that, in the seed: both are tagged, so a list mixing them
decodes). Imports :mod:`specdec.datamodel.sequence` only; the wire helpers, and the seed's ``apply_delta``,
``finish_step`` and ``is_single_step_prompt`` (the step calls none of them), are :mod:`specdec.vllm_compat`'s.
Knows nothing about models, tensors or KV caches.
"""

from __future__ import annotations

import msgspec

from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import SequenceData, SequenceDataDelta, SequenceGroupState


class SequenceGroupMetadataDelta(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """What changed in a SequenceGroupMetadata since the last step (see ``specdec.vllm_compat.apply_delta``)."""

    seq_data_delta: dict[int, SequenceDataDelta]  # seq_id -> its SequenceDataDelta
    request_id: str
    block_tables: dict[int, list[int]]  # seq_id -> KV blocks (or [slot]), overwritten
    is_prompt: bool  # overwritten
    do_sample: bool = True  # overwritten
    token_chunk_size: int | None = None  # overwritten
    state: SequenceGroupState | None = msgspec.field(default_factory=SequenceGroupState)


class SequenceGroupMetadata(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Everything a worker needs about one request for one step."""

    request_id: str
    is_prompt: bool  # the step runs (part of) the prompt
    seq_data: dict[int, SequenceData]  # seq_id -> its tokens and progress
    sampling_params: SamplingParams | None = None  # None for steps that do not sample
    block_tables: dict[int, list[int]] = msgspec.field(default_factory=dict)  # seq_id -> KV blocks
    # False for a non-final chunk of a chunked prefill: the model runs but nothing is sampled.
    do_sample: bool = True
    state: SequenceGroupState | None = msgspec.field(default_factory=SequenceGroupState)
    # Tokens to run per sequence this step. None -> the whole sequence for a prompt, else 1.
    token_chunk_size: int | None = None
    # k for this request this step. None: no speculation configured; 0: switched off this step
    # (e.g. running_queue_size >= disable_by_batch_size, or too close to max_model_len).
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.token_chunk_size is None and self.seq_data:
            first = self.first_seq_data()
            self.token_chunk_size = first.get_len() if self.is_prompt else 1

    def first_seq(self) -> tuple[int, SequenceData]:
        """(seq id, data) of the group's first sequence. The step runs one sequence per group (the ``n``
        children of a request are groups of their own), so this is the group's sequence."""
        return next(iter(self.seq_data.items()))

    def get_first_seq_id(self) -> int:
        return self.first_seq()[0]

    def first_seq_data(self) -> SequenceData:
        return self.first_seq()[1]

def get_all_seq_ids(seq_group_metadata_list: list[SequenceGroupMetadata]) -> list[int]:
    """The seq ids of a batch, group after group (the row order of its tensors)."""
    return [seq_id for sg in seq_group_metadata_list for seq_id in sg.seq_data]
