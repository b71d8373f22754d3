"""The seed-compatibility surface of the data model: what ``vllm.sequence`` offers that the step loop
does not use, and every name of the data model in one namespace (``from specdec.vllm_compat import X``
works for each name ``vllm.sequence`` has here).

Here: the model outputs (``SequenceOutput``, ``CompletionSequenceGroupOutput``), ``IntermediateTensors``
(named tensors between pipeline stages) and the wire helpers ``encode_msgpack``/``decode_msgpack``/
``encode_json``/``decode_json``, which carry the ``array('l')`` token ids of ``SequenceData`` (msgspec
has no native ``array`` support: a bare ``msgspec.json.encode(sequence_data)`` fails) and refuse tensors.
Every tensor-free struct of the data model round-trips through them, in msgpack and in JSON.
The seed's delta and multi-step surface lives on the structs themselves (``SequenceData.get_delta_and_reset``,
``SequenceGroupMetadata.apply_delta``, ``ExecuteModelRequest``'s swap and multi-step fields), which keep
the seed's fields and behaviour. Imports the data model's other modules; nothing imports this one but tests
and users.
"""

from __future__ import annotations

from array import array
from functools import lru_cache
from typing import Any

import msgspec
import torch

from specdec.datamodel.hidden_states import ExecuteModelRequest, HiddenStates
from specdec.datamodel.sequence import (
    VLLM_INVALID_TOKEN_ID,
    VLLM_TOKEN_ID_ARRAY_TYPE,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    SampleLogprobs,
    Sequence,
    SequenceData,
    SequenceDataDelta,
    SequenceGroup,
    SequenceGroupState,
    SequenceStage,
    SequenceStatus,
    array_full,
)
from specdec.datamodel.metadata import SequenceGroupMetadata, SequenceGroupMetadataDelta, get_all_seq_ids

__all__ = [
    "VLLM_INVALID_TOKEN_ID", "VLLM_TOKEN_ID_ARRAY_TYPE", "CompletionSequenceGroupOutput", "ExecuteModelRequest",
    "HiddenStates", "IntermediateTensors", "Logprob", "PromptLogprobs", "RequestMetrics", "SampleLogprobs",
    "Sequence", "SequenceData", "SequenceDataDelta", "SequenceGroup", "SequenceGroupMetadata",
    "SequenceGroupMetadataDelta", "SequenceGroupState", "SequenceOutput", "SequenceStage", "SequenceStatus",
    "array_full", "decode_json", "decode_msgpack", "encode_json", "encode_msgpack", "get_all_seq_ids",
]


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


class IntermediateTensors(msgspec.Struct, array_like=True, omit_defaults=True):
    """Named tensors (e.g. ``hidden_states``, ``residual``) passed between model stages."""

    tensors: dict[str, torch.Tensor]  # name -> [num_tokens, hidden_size]

    def __getitem__(self, key: str | slice) -> torch.Tensor | IntermediateTensors:
        if isinstance(key, slice):  # the same token rows of every tensor
            return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        # The seed returns `self` here (always truthy). Compare names, then each tensor exactly.
        if not isinstance(other, IntermediateTensors):
            return NotImplemented
        if self.tensors.keys() != other.tensors.keys():
            return False
        return all(_same_tensor(v, other.tensors[k]) for k, v in self.tensors.items())

    def __repr__(self) -> str:
        return f"IntermediateTensors(tensors={self.tensors})"


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and torch.equal(a, b))


# -- serialisation ---------------------------------------------------------------------------------
def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, array):
        return obj.tolist()
    if type(obj).__module__.startswith("torch"):
        raise TypeError(f"Cannot serialise a {type(obj).__name__}: specdec sends tensors in-process "
                        "only; leave tensor fields (and SequenceGroupState.generator) None on the wire.")
    raise NotImplementedError(f"specdec.vllm_compat cannot serialise objects of type {type(obj)!r}.")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is array:
        return array(VLLM_TOKEN_ID_ARRAY_TYPE, obj)  # TypeError on non-ints -> msgspec.ValidationError
    raise NotImplementedError(f"specdec.vllm_compat cannot deserialise objects of type {type_!r}.")


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
