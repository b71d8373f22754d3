"""specdec/vllm_compat.py: the seed-compatibility surface. Every tensor-free struct of the data model
round-trips through the msgpack and JSON helpers (token-id arrays stay live arrays; bad ids and tensors are
refused); the model outputs compare by value; IntermediateTensors compares and slices by tensor; the
module has every name of vllm.sequence, and no data-model module imports a later one (no circle)."""

from __future__ import annotations

from array import array

import msgspec
import pytest
import torch

import specdec.datamodel.hidden_states
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import (
    VLLM_TOKEN_ID_ARRAY_TYPE, Logprob, RequestMetrics, SequenceData, SequenceDataDelta, SequenceGroupState,
    SequenceStage,
)
from specdec.datamodel.metadata import SequenceGroupMetadata, SequenceGroupMetadataDelta
from specdec.vllm_compat import (
    CompletionSequenceGroupOutput, IntermediateTensors, SequenceOutput, decode_json, decode_msgpack, encode_json,
    encode_msgpack, get_delta_and_reset, update_num_computed_tokens,
)

CODECS = {"msgpack": (encode_msgpack, decode_msgpack), "json": (encode_json, decode_json)}


def _busy_seq_data() -> SequenceData:
    """A SequenceData with every field away from its default."""
    data = SequenceData.from_seqs([5, 6, 7], [8])
    update_num_computed_tokens(data, 4)  # all 4 tokens computed -> DECODE
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
    assert get_delta_and_reset(decoded).new_output_token_ids == [9, 10]


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


# -- model outputs ---------------------------------------------------------------------------------
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


# -- IntermediateTensors ---------------------------------------------------------------------------
def test_intermediate_tensors_eq() -> None:
    a = IntermediateTensors({"hidden_states": torch.ones(2, 3), "residual": torch.zeros(2, 3)})
    same = IntermediateTensors({"residual": torch.zeros(2, 3), "hidden_states": torch.ones(2, 3)})
    assert a == same
    other_values = IntermediateTensors({"hidden_states": torch.ones(2, 3), "residual": torch.ones(2, 3)})
    assert (a == other_values) is False  # the seed returned `self` here: always truthy
    assert a != IntermediateTensors({"hidden_states": torch.ones(2, 3)})  # a key missing
    assert a != IntermediateTensors({"hidden_states": torch.ones(2, 3), "other": torch.zeros(2, 3)})
    assert a != IntermediateTensors({"hidden_states": torch.ones(2, 3, dtype=torch.float64),
                                     "residual": torch.zeros(2, 3)})  # same values, other dtype
    assert a != IntermediateTensors({"hidden_states": torch.ones(3, 2), "residual": torch.zeros(2, 3)})
    assert a.__eq__({"hidden_states": torch.ones(2, 3)}) is NotImplemented and a != 3


def test_intermediate_tensors_container() -> None:
    it = IntermediateTensors({"hidden_states": torch.arange(6.0).view(3, 2)})
    it["residual"] = torch.zeros(3, 2)
    assert len(it) == 2 and torch.equal(it["residual"], torch.zeros(3, 2))
    head = it[:2]  # the first two token rows of every tensor
    assert isinstance(head, IntermediateTensors) and head["hidden_states"].tolist() == [[0, 1], [2, 3]]
    assert head["residual"].shape == (2, 2)


# -- one namespace, no circle ----------------------------------------------------------------------
def test_vllm_compat_has_every_name_of_the_data_model_and_no_module_imports_a_later_one() -> None:
    """vllm.sequence's names in one namespace; the layers import only the ones above them (no circle)."""
    import ast
    import inspect

    import specdec.datamodel.sequence as sequence
    import specdec.datamodel.metadata as metadata
    import specdec.vllm_compat as compat

    assert compat.HiddenStates is specdec.datamodel.hidden_states.HiddenStates
    assert compat.ExecuteModelRequest is specdec.datamodel.hidden_states.ExecuteModelRequest
    assert all(hasattr(compat, n) for n in compat.__all__)
    layers = ["specdec.datamodel.sequence", "specdec.datamodel.metadata", "specdec.datamodel.hidden_states", "specdec.vllm_compat"]
    for i, mod in enumerate((sequence, metadata, specdec.datamodel.hidden_states, compat)):
        imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(mod))) if isinstance(n, ast.ImportFrom)}
        assert not imported & set(layers[i:]), f"{mod.__name__} imports a module at or below its own layer"


def test_the_seed_only_methods_live_in_vllm_compat_alone() -> None:
    """The step never calls them: the structs do not carry them, vllm_compat has them as functions."""
    import specdec.vllm_compat as compat
    from specdec.datamodel.hidden_states import ExecuteModelRequest, HiddenStates
    from specdec.datamodel.sequence import Sequence, SequenceGroup

    moved = {
        SequenceData: ["get_delta_and_reset", "apply_delta", "update_num_computed_tokens",
                       "get_num_uncomputed_tokens", "reset_state_for_recompute"],
        Sequence: ["get_num_new_tokens", "reset_state_for_recompute"],
        SequenceGroupState: ["remaining_steps"],
        SequenceGroup: ["init_multi_step", "set_last_token_time", "get_last_token_latency",
                        "update_num_computed_tokens", "get_num_uncomputed_tokens"],
        SequenceGroupMetadata: ["apply_delta", "finish_step", "is_single_step_prompt"],
        HiddenStates: ["update", "prune", "expand_with_bonus_tokens"],
        ExecuteModelRequest: ["is_first_multi_step", "is_last_step", "current_step", "clone", "_first_state"],
    }
    for cls, names in moved.items():
        assert [n for n in names if hasattr(cls, n)] == [], cls.__name__
    functions = {"update": "hidden_states_update", "prune": "hidden_states_prune", "clone": "clone_request",
                 "_first_state": "_first_state"}
    for names in moved.values():
        assert all(callable(getattr(compat, functions.get(n, n))) for n in names)
    assert not hasattr(specdec.datamodel.sequence, "array_full") and callable(compat.array_full)
