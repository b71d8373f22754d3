"""The seed-compatibility surface of the data model: what ``vllm.sequence`` offers that the step loop
does not use, and every name of the data model in one namespace (``from specdec.vllm_compat import X``
works for each name ``vllm.sequence`` has here).

Here: the model outputs (``SequenceOutput``, ``CompletionSequenceGroupOutput``), ``IntermediateTensors``
(named tensors between pipeline stages), the wire helpers ``encode_msgpack``/``decode_msgpack``/
``encode_json``/``decode_json``, which carry the ``array('l')`` token ids of ``SequenceData`` (msgspec
has no native ``array`` support: a bare ``msgspec.json.encode(sequence_data)`` fails) and refuse tensors.
Every tensor-free struct of the data model round-trips through them, in msgpack and in JSON.

The seed's methods that nothing in the step calls live here too, as functions taking the struct first,
named after the method (``seq_data.get_delta_and_reset()`` -> ``get_delta_and_reset(seq_data)``; the
vague ones prefixed: ``hidden_states_update``/``hidden_states_prune``, ``clone_request``): ``array_full``, deltas,
computed-token progress, decode timings, multi-step counters, ``ExecuteModelRequest.clone`` and the seed's
HiddenStates bookkeeping (see the last section). The structs keep every field of the seed; only this
behaviour moved, so the data-model modules hold what the step runs. Functions, not subclasses adding the
methods: the step, the data model's own methods (``HiddenStates.select``/``copy``) and the decoders build
the data model's classes, so a subclass's methods would be missing from exactly the instances a user is
handed (a proposer's ``previous_hidden_states``, a decoded metadata's ``seq_data``); a function works on
every instance, and each class exported here is the data model's own. So every name imports as from
``vllm.sequence``, and a seed method call ``x.m(...)`` reads ``m(x, ...)``.

Imports the data model's modules; it sits above them (they never import it), and nothing imports it but
tests and users.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
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
)
from specdec.datamodel.metadata import SequenceGroupMetadata, SequenceGroupMetadataDelta, get_all_seq_ids

__all__ = [
    # the data model's names, as vllm.sequence has them
    "VLLM_INVALID_TOKEN_ID", "VLLM_TOKEN_ID_ARRAY_TYPE", "CompletionSequenceGroupOutput", "ExecuteModelRequest",
    "HiddenStates", "IntermediateTensors", "Logprob", "PromptLogprobs", "RequestMetrics", "SampleLogprobs",
    "Sequence", "SequenceData", "SequenceDataDelta", "SequenceGroup", "SequenceGroupMetadata",
    "SequenceGroupMetadataDelta", "SequenceGroupState", "SequenceOutput", "SequenceStage", "SequenceStatus",
    "array_full", "decode_json", "decode_msgpack", "encode_json", "encode_msgpack", "get_all_seq_ids",
    # the seed's methods the step never calls, as functions of the struct
    "apply_delta", "clone_request", "current_step", "expand_with_bonus_tokens", "finish_step",
    "get_delta_and_reset", "get_last_token_latency", "get_num_new_tokens", "get_num_uncomputed_tokens",
    "hidden_states_prune", "hidden_states_update", "init_multi_step", "is_first_multi_step", "is_last_step",
    "is_single_step_prompt", "remaining_steps", "reset_state_for_recompute", "set_last_token_time",
    "update_num_computed_tokens",
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


# -- the seed's methods the step never calls ---------------------------------------------------------
# Each is `Struct.method(self, ...)` of vllm.sequence as `method(struct, ...)`, with the seed's semantics
# (and specdec's fixes, noted). This is the data model's own seed layer: it writes the structs' private
# fields (`_num_computed_tokens`, `_stage`, `_seq_ids`...) and uses HiddenStates' row primitives
# `_take`/`_require_seq_ids`, as the methods did.

def array_full(token_id: int, count: int) -> array:
    """``array('l')`` of ``count`` copies of ``token_id``."""
    return array(VLLM_TOKEN_ID_ARRAY_TYPE, [token_id]) * count


# SequenceData / Sequence / SequenceGroup: computed-token progress and stage
def get_num_uncomputed_tokens(obj: SequenceData | SequenceGroup) -> int:
    """Tokens not yet run through the model: of a SequenceData, or summed over a group's unfinished sequences."""
    if isinstance(obj, SequenceGroup):
        return sum(get_num_uncomputed_tokens(seq.data) for seq in obj.get_unfinished_seqs())
    # get_len(), not the prompt length: after a preemption the output is recomputed too.
    return obj.get_len() - obj.get_num_computed_tokens()


def update_num_computed_tokens(obj: SequenceData | SequenceGroup, num_new_computed_tokens: int) -> None:
    """Count tokens that just ran through the model (a group: for each unfinished sequence); all of them
    computed -> DECODE stage."""
    if isinstance(obj, SequenceGroup):
        for seq in obj.get_unfinished_seqs():
            update_num_computed_tokens(seq.data, num_new_computed_tokens)
        return
    done = obj.get_num_computed_tokens()
    total = done + num_new_computed_tokens
    if not 0 <= total <= obj.get_len():
        raise ValueError(f"SequenceData: {done} + {num_new_computed_tokens} computed tokens is outside "
                         f"[0, {obj.get_len()}] (the sequence length).")
    obj._num_computed_tokens = total
    if get_num_uncomputed_tokens(obj) == 0:
        obj._stage = SequenceStage.DECODE


def reset_state_for_recompute(obj: SequenceData | Sequence) -> None:
    """Start over from token 0 (the sequence was preempted and its KV cache dropped)."""
    data = obj.data if isinstance(obj, Sequence) else obj
    data._num_computed_tokens = 0
    data._stage = SequenceStage.PREFILL
    data._new_appended_tokens = []


def get_num_new_tokens(seq: Sequence) -> int:
    """Tokens to run next step without speculation: 1 when decoding, the rest of the prefill."""
    return 1 if seq.data.stage == SequenceStage.DECODE else get_num_uncomputed_tokens(seq.data)


# SequenceData / SequenceGroupMetadata: deltas
def get_delta_and_reset(data: SequenceData) -> SequenceDataDelta:
    """What changed since the last call (tokens appended, progress), and forget the appended tokens."""
    delta = SequenceDataDelta(data._new_appended_tokens, data.cumulative_logprob,
                              data.get_num_computed_tokens(), data.stage)
    data._new_appended_tokens = []
    return delta


def apply_delta(obj: SequenceData | SequenceGroupMetadata,
                delta: SequenceDataDelta | SequenceGroupMetadataDelta) -> None:
    """Replay on a worker's copy what the scheduler's copy did: a SequenceDataDelta on a SequenceData, a
    SequenceGroupMetadataDelta (refused for another request) on a SequenceGroupMetadata."""
    if isinstance(obj, SequenceData) and isinstance(delta, SequenceDataDelta):
        obj._output_token_ids.extend(delta.new_output_token_ids)
        obj._cumulative_logprob = delta.new_cumulative_logprob
        obj._num_computed_tokens = delta.new_num_computed_tokens
        obj._stage = delta.new_stage
        return
    if not (isinstance(obj, SequenceGroupMetadata) and isinstance(delta, SequenceGroupMetadataDelta)):
        raise TypeError(f"apply_delta: a SequenceDataDelta applies to a SequenceData, a SequenceGroupMetadataDelta "
                        f"to a SequenceGroupMetadata; got {type(delta).__name__} on {type(obj).__name__}.")
    if delta.request_id != obj.request_id:
        raise ValueError(f"SequenceGroupMetadata {obj.request_id!r} was given the delta of "
                         f"request {delta.request_id!r}.")
    for seq_id, seq_delta in delta.seq_data_delta.items():
        apply_delta(obj.seq_data[seq_id], seq_delta)
    obj.block_tables = delta.block_tables
    obj.token_chunk_size = delta.token_chunk_size
    obj.do_sample = delta.do_sample
    obj.is_prompt = delta.is_prompt


def is_single_step_prompt(meta: SequenceGroupMetadata) -> bool:
    """A prompt that samples: the last (or only) chunk of a prefill."""
    return meta.is_prompt and meta.do_sample


# SequenceGroup: decode timings
def set_last_token_time(group: SequenceGroup, now: float) -> None:
    """Record a token emission at ``now``; its latency is readable via :func:`get_last_token_latency`."""
    if group.is_prefill():
        raise ValueError(f"SequenceGroup {group.request_id!r} is still in prefill: "
                         "set_last_token_time is for decode steps.")
    group.last_token_latency = now - group.metrics.last_token_time
    group.metrics.last_token_time = now


def get_last_token_latency(group: SequenceGroup) -> float:
    return group.last_token_latency


# multi-step decoding: SequenceGroup, SequenceGroupState, SequenceGroupMetadata, ExecuteModelRequest
def init_multi_step(group: SequenceGroup, num_steps: int) -> None:
    group.state.num_steps = num_steps
    group.state.current_step = 0


def remaining_steps(state: SequenceGroupState) -> int:
    return state.num_steps - state.current_step


def finish_step(meta: SequenceGroupMetadata) -> None:
    """Advance the multi-step counter of ``meta.state`` by one."""
    if meta.state is None or meta.state.current_step >= meta.state.num_steps:
        raise ValueError(f"SequenceGroupMetadata {meta.request_id!r}: no step left to finish "
                         f"(state={meta.state}).")
    meta.state.current_step += 1


def _first_state(req: ExecuteModelRequest) -> SequenceGroupState:
    # Every group of a batch runs the same number of steps: the first one speaks for all.
    if not req.seq_group_metadata_list or req.seq_group_metadata_list[0].state is None:
        raise ValueError("ExecuteModelRequest: the multi-step properties need a non-empty "
                         "seq_group_metadata_list whose first entry has a state.")
    return req.seq_group_metadata_list[0].state


def is_first_multi_step(req: ExecuteModelRequest) -> bool:
    return _first_state(req).current_step == 0


def is_last_step(req: ExecuteModelRequest) -> bool:
    return remaining_steps(_first_state(req)) == 1


def current_step(req: ExecuteModelRequest) -> int:
    return _first_state(req).current_step


def clone_request(req: ExecuteModelRequest,
                  seq_group_metadata_list: list[SequenceGroupMetadata | SequenceGroupMetadataDelta]
                  ) -> ExecuteModelRequest:
    """``ExecuteModelRequest.clone``: the same request over another batch. Lists, ``last_sampled_token_ids``
    and the ``HiddenStates`` bookkeeping are copied, so e.g. expanding the clone's hidden states for bonus
    tokens leaves ``req``'s untouched (the seed shares the HiddenStates)."""
    hidden = req.previous_hidden_states
    last = req.last_sampled_token_ids
    return ExecuteModelRequest(
        seq_group_metadata_list=seq_group_metadata_list,
        blocks_to_swap_in=list(req.blocks_to_swap_in),
        blocks_to_swap_out=list(req.blocks_to_swap_out),
        blocks_to_copy=list(req.blocks_to_copy),
        virtual_engine=req.virtual_engine,
        num_lookahead_slots=req.num_lookahead_slots,
        running_queue_size=req.running_queue_size,
        previous_hidden_states=None if hidden is None else hidden.copy(),
        num_steps=req.num_steps,
        spec_step_idx=req.spec_step_idx,
        finished_requests_ids=list(req.finished_requests_ids),
        last_sampled_token_ids=None if last is None else last.clone(),
        async_callback=req.async_callback,
    )


# HiddenStates: the seed's one-row-per-sequence bookkeeping (the step threads rows with extend/select/discard)
def hidden_states_update(hs: HiddenStates, hidden_states: torch.Tensor,
                         seq_group_metadata_list: list[SequenceGroupMetadata],
                         second_last_token_hidden_states: torch.Tensor | None = None) -> None:
    """``HiddenStates.update``: append the states of a new step, ``hidden_states`` [num_new_seqs, hidden_size].

    A sequence that already has rows gets them replaced (the new state is newer; the seed keeps both and
    later reads the stale one). A missing second-last side is padded with zeros.
    """
    new_ids = get_all_seq_ids(seq_group_metadata_list)
    if hidden_states.shape[0] != len(new_ids):
        raise ValueError(f"HiddenStates.update: {hidden_states.shape[0]} rows for "
                         f"{len(new_ids)} sequences; pass one row per sequence.")
    if (second_last_token_hidden_states is not None
            and second_last_token_hidden_states.shape[0] != hidden_states.shape[0]):
        raise ValueError(f"HiddenStates.update: second_last_token_hidden_states has "
                         f"{second_last_token_hidden_states.shape[0]} rows, hidden_states "
                         f"{hidden_states.shape[0]}; they must match row for row.")
    hs._require_seq_ids("update")
    superseded = set(new_ids)
    hs._take([i for i, s in enumerate(hs.seq_ids) if s not in superseded])
    old_second = hs.second_last_token_hidden_states
    if old_second is not None or second_last_token_hidden_states is not None:
        # Zero rows stand in for "no second-last state": only bonus sequences ever read one.
        hs.second_last_token_hidden_states = torch.cat([
            torch.zeros_like(hs.hidden_states) if old_second is None else old_second,
            torch.zeros_like(hidden_states) if second_last_token_hidden_states is None
            else second_last_token_hidden_states])
    hs.hidden_states = torch.cat([hs.hidden_states, hidden_states])
    hs._seq_ids = hs.seq_ids + new_ids


def hidden_states_prune(hs: HiddenStates, seq_group_metadata_list: list[SequenceGroupMetadata]) -> None:
    """``HiddenStates.prune``: keep only the rows of the batch's sequences, in the batch's order."""
    wanted = list(dict.fromkeys(get_all_seq_ids(seq_group_metadata_list)))
    held = hs.seq_ids
    if wanted == held:
        return
    hs._require_seq_ids("prune")
    rows_of: dict[int, list[int]] = defaultdict(list)
    for i, seq_id in enumerate(held):
        rows_of[seq_id].append(i)
    missing = [s for s in wanted if s not in rows_of]
    if missing:
        raise ValueError(f"HiddenStates.prune: no hidden state for seq ids {missing} (it holds "
                         f"{sorted(rows_of)}); run a non-speculative step for them first.")
    hs._take([i for s in wanted for i in rows_of[s]])


def expand_with_bonus_tokens(hs: HiddenStates, seq_with_bonus_token_in_last_step: set[int]) -> None:
    """``HiddenStates.expand_with_bonus_tokens``: re-insert the second-last state right before the last one
    for each bonus sequence.

    The draft never saw the last accepted draft token of a sequence that also got a bonus token, so it runs
    two positions for it (see the proposer's expanded request). ``hs.seq_ids`` then holds that sequence
    twice, in row order (the seed left it stale). The second-last states are spent:
    ``second_last_token_hidden_states`` becomes None. A no-op without them.
    """
    second = hs.second_last_token_hidden_states
    if second is None or not seq_with_bonus_token_in_last_step:
        return
    hs._require_seq_ids("expand_with_bonus_tokens")
    held = hs.seq_ids
    index: list[int] = []  # rows of cat([hidden_states, second_last])
    for i, seq_id in enumerate(held):
        if seq_id in seq_with_bonus_token_in_last_step:
            index.append(len(held) + i)
        index.append(i)
    hs.hidden_states = torch.cat([hs.hidden_states, second])
    hs.second_last_token_hidden_states = None
    hs._seq_ids = held + held  # row owners of the concatenation
    hs._take(index)
