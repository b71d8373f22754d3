"""Per-step metadata, model outputs and the msgspec helpers of the data model (after ``vllm.sequence``).

``SequenceGroupMetadata`` is what the scheduler hands the worker for one request each step (the full
thing the first time, a ``SequenceGroupMetadataDelta`` after that: both are tagged, so a list mixing
them decodes). ``SequenceOutput``/``CompletionSequenceGroupOutput`` are what comes back per request.

Everything here is tensor-free and round-trips through :func:`encode_msgpack`/:func:`decode_msgpack`
and :func:`encode_json`/:func:`decode_json`, which know how to carry the ``array('l')`` token ids of
``SequenceData`` (msgspec has no native ``array`` support). All names are re-exported by
:mod:`specdec.sequence`. Knows nothing about models, tensors or KV caches.
"""

from __future__ import annotations

from array import array
from functools import lru_cache
from typing import Any

import msgspec

from specdec.sampling_params import SamplingParams
from specdec.sequence import (
    VLLM_TOKEN_ID_ARRAY_TYPE,
    Logprob,
    PromptLogprobs,
    SequenceData,
    SequenceDataDelta,
    SequenceGroupState,
)


class SequenceGroupMetadataDelta(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """What changed in a SequenceGroupMetadata since the last step (see ``apply_delta``)."""

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
            first = next(iter(self.seq_data.values()))
            self.token_chunk_size = first.get_len() if self.is_prompt else 1

    @property
    def is_single_step_prompt(self) -> bool:
        # A prompt that samples: the last (or only) chunk of a prefill.
        return self.is_prompt and self.do_sample

    def get_first_seq_id(self) -> int:
        return next(iter(self.seq_data))

    def apply_delta(self, delta: SequenceGroupMetadataDelta) -> None:
        if delta.request_id != self.request_id:
            raise ValueError(f"SequenceGroupMetadata {self.request_id!r} was given the delta of "
                             f"request {delta.request_id!r}.")
        for seq_id, seq_delta in delta.seq_data_delta.items():
            self.seq_data[seq_id].apply_delta(seq_delta)
        self.block_tables = delta.block_tables
        self.token_chunk_size = delta.token_chunk_size
        self.do_sample = delta.do_sample
        self.is_prompt = delta.is_prompt

    def finish_step(self) -> None:
        """Advance the multi-step counter of ``state`` by one."""
        if self.state is None or self.state.current_step >= self.state.num_steps:
            raise ValueError(f"SequenceGroupMetadata {self.request_id!r}: no step left to finish "
                             f"(state={self.state}).")
        self.state.current_step += 1


class SequenceOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One token the model emitted for one sequence."""

    parent_seq_id: int  # the sequence it extends
    output_token: int  # the emitted token id
    logprobs: dict[int, Logprob]  # token_id -> Logprob: the emitted token and any top-n alternatives

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceOutput):
            return NotImplemented
        return (self.parent_seq_id == other.parent_seq_id and self.output_token == other.output_token
                and self.logprobs == other.logprobs)


class CompletionSequenceGroupOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    samples: list[SequenceOutput]  # one per sequence of the group
    prompt_logprobs: PromptLogprobs | None  # one entry per prompt token; None if not requested

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionSequenceGroupOutput):
            return NotImplemented
        return self.samples == other.samples and self.prompt_logprobs == other.prompt_logprobs


def get_all_seq_ids(seq_group_metadata_list: list[SequenceGroupMetadata]) -> list[int]:
    """The seq ids of a batch, group after group (the row order of its tensors)."""
    return [seq_id for sg in seq_group_metadata_list for seq_id in sg.seq_data]


# -- serialisation ---------------------------------------------------------------------------------
def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, array):
        return obj.tolist()
    if type(obj).__module__.startswith("torch"):
        raise TypeError(f"Cannot serialise a {type(obj).__name__}: specdec sends tensors in-process "
                        "only; leave tensor fields (and SequenceGroupState.generator) None on the wire.")
    raise NotImplementedError(f"specdec.sequence cannot serialise objects of type {type(obj)!r}.")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is array:
        return array(VLLM_TOKEN_ID_ARRAY_TYPE, obj)  # TypeError on non-ints -> msgspec.ValidationError
    raise NotImplementedError(f"specdec.sequence cannot deserialise objects of type {type_!r}.")


_MSGPACK_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_JSON_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


@lru_cache(maxsize=64)
def _decoder(kind: str, type_: Any) -> msgspec.msgpack.Decoder | msgspec.json.Decoder:
    module = msgspec.msgpack if kind == "msgpack" else msgspec.json
    return module.Decoder(type_, dec_hook=_dec_hook)


def encode_msgpack(obj: Any) -> bytes:
    """msgpack bytes of any tensor-free object of the data model (token-id arrays become lists)."""
    return _MSGPACK_ENCODER.encode(obj)


def decode_msgpack(data: bytes, type: Any) -> Any:  # noqa: A002  (mirrors msgspec's `type=`)
    """Inverse of :func:`encode_msgpack`; ``type`` may be a struct, ``list[A | B]``, a dict..."""
    return _decoder("msgpack", type).decode(data)


def encode_json(obj: Any) -> bytes:
    """JSON bytes of any tensor-free object of the data model (token-id arrays become lists)."""
    return _JSON_ENCODER.encode(obj)


def decode_json(data: bytes | str, type: Any) -> Any:  # noqa: A002
    """Inverse of :func:`encode_json`."""
    return _decoder("json", type).decode(data)
