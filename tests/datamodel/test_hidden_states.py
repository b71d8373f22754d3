"""specdec.datamodel.hidden_states with the seed's methods specdec.vllm_compat holds as functions: HiddenStates
(hidden_states_update / hidden_states_prune / expand_with_bonus_tokens) vs a plain-list model; ExecuteModelRequest's
multi-step properties and clone_request."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.datamodel.hidden_states import ExecuteModelRequest, HiddenStates
from specdec.datamodel.sequence import SequenceData, SequenceGroupState
from specdec.datamodel.metadata import get_all_seq_ids, SequenceGroupMetadata
from specdec.vllm_compat import (
    clone_request, current_step, expand_with_bonus_tokens, finish_step, hidden_states_prune, hidden_states_update,
    is_first_multi_step, is_last_step,
)

HIDDEN_SIZE = 2


def meta(*seq_ids: int) -> list[SequenceGroupMetadata]:
    """One single-sequence group per seq id, in that order."""
    return [SequenceGroupMetadata(f"req-{s}", False, {s: SequenceData.from_seqs([1, 2])}) for s in seq_ids]


def rows(values: list[float]) -> torch.Tensor:
    """[len(values), HIDDEN_SIZE]: row i is (v, -v), so a row is identified by its value."""
    col = torch.tensor(values, dtype=torch.float32).view(-1, 1)
    return torch.cat([col, -col], dim=1)


def values(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else t[:, 0].tolist()


class ListModel:
    """Reference: the same operations on plain lists, one (seq_id, state, second-last) entry a row."""

    def __init__(self, ids: list[int], h: list[float], second: list[float] | None) -> None:
        self.ids, self.h, self.second = list(ids), list(h), None if second is None else list(second)

    def update(self, ids: list[int], h: list[float], second: list[float] | None) -> None:
        keep = [i for i, s in enumerate(self.ids) if s not in ids]  # newer states replace older ones
        if self.second is not None or second is not None:
            old = [self.second[i] for i in keep] if self.second is not None else [0.0] * len(keep)
            self.second = old + (second if second is not None else [0.0] * len(ids))
        self.ids = [self.ids[i] for i in keep] + ids
        self.h = [self.h[i] for i in keep] + h

    def prune(self, wanted: list[int]) -> None:
        order = [i for s in wanted for i, t in enumerate(self.ids) if t == s]
        self.ids = [self.ids[i] for i in order]
        self.h = [self.h[i] for i in order]
        if self.second is not None:
            self.second = [self.second[i] for i in order]

    def expand(self, bonus: set[int]) -> None:
        if self.second is None or not bonus:
            return
        ids, h = [], []
        for s, state, second in zip(self.ids, self.h, self.second):
            if s in bonus:  # the second-last state goes right before the last one
                ids.append(s)
                h.append(second)
            ids.append(s)
            h.append(state)
        self.ids, self.h, self.second = ids, h, None


SEQ_IDS = st.integers(min_value=0, max_value=5)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_hidden_states_matches_list_model(data: st.DataObject) -> None:
    counter = iter(range(1, 10_000))  # every row gets a fresh value: a row is traceable by value

    def fresh(n: int) -> list[float]:
        return [float(next(counter)) for _ in range(n)]

    def fresh_second(n: int) -> list[float] | None:
        if not data.draw(st.booleans(), label="with second-last"):
            return None
        return [1000.0 + v for v in fresh(n)]

    ids = data.draw(st.lists(SEQ_IDS, unique=True, max_size=5), label="initial seqs")
    h, second = fresh(len(ids)), fresh_second(len(ids))
    hs = HiddenStates(rows(h), meta(*ids), None if second is None else rows(second))
    ref = ListModel(ids, h, second)
    for _ in range(data.draw(st.integers(1, 8), label="num ops")):
        op = data.draw(st.sampled_from(["update", "prune", "expand"]), label="op")
        if op == "update":
            new_ids = data.draw(st.lists(SEQ_IDS, unique=True, max_size=4), label="update seqs")
            new_h, new_second = fresh(len(new_ids)), fresh_second(len(new_ids))
            hidden_states_update(hs, rows(new_h), meta(*new_ids), None if new_second is None else rows(new_second))
            ref.update(new_ids, new_h, new_second)
        elif op == "prune":
            present = list(dict.fromkeys(ref.ids))
            wanted = data.draw(st.permutations(present), label="prune order")
            wanted = wanted[:data.draw(st.integers(0, len(wanted)), label="prune keep")]
            hidden_states_prune(hs, meta(*wanted))
            ref.prune(wanted)
        else:
            bonus = data.draw(st.sets(SEQ_IDS), label="bonus seqs")
            expand_with_bonus_tokens(hs, bonus)
            ref.expand(bonus)
        assert hs.seq_ids == ref.ids, op
        assert values(hs.hidden_states) == ref.h, op
        assert values(hs.second_last_token_hidden_states) == ref.second, op
        assert hs.hidden_states.shape == (len(ref.ids), HIDDEN_SIZE)


def test_expand_keeps_seq_ids_in_step_with_rows() -> None:
    # Regression (seed bug): after expansion `_seq_ids` kept one entry per sequence while
    # hidden_states had one more row per bonus sequence, so a later prune picked wrong rows.
    hs = HiddenStates(rows([1.0, 2.0, 3.0]), meta(10, 11, 12), rows([-1.0, -2.0, -3.0]))
    expand_with_bonus_tokens(hs, {11})
    assert values(hs.hidden_states) == [1.0, -2.0, 2.0, 3.0]  # 11's second-last, then its last
    assert hs.seq_ids == [10, 11, 11, 12]
    # The proposer's expanded request lists the bonus sequence twice too (without, then with its
    # last token): the rows line up with it.
    assert hs.seq_ids == get_all_seq_ids(meta(10, 11, 11, 12))
    assert hs.second_last_token_hidden_states is None  # spent
    hidden_states_prune(hs, meta(12, 11))
    assert hs.seq_ids == [12, 11, 11] and values(hs.hidden_states) == [3.0, -2.0, 2.0]


def test_expand_is_a_no_op_without_second_last_states_or_bonus() -> None:
    hs = HiddenStates(rows([1.0, 2.0]), meta(0, 1))
    expand_with_bonus_tokens(hs, {0})
    assert hs.seq_ids == [0, 1] and values(hs.hidden_states) == [1.0, 2.0]
    hs = HiddenStates(rows([1.0]), meta(0), rows([5.0]))
    expand_with_bonus_tokens(hs, set())
    assert hs.seq_ids == [0] and values(hs.second_last_token_hidden_states) == [5.0]


def test_update_replaces_a_sequences_older_state() -> None:
    hs = HiddenStates(rows([1.0, 2.0]), meta(0, 1))
    hidden_states_update(hs, rows([3.0]), meta(0))
    hidden_states_prune(hs, meta(0, 1))
    assert values(hs.hidden_states) == [3.0, 2.0]  # the seed would hand back the stale 1.0


def test_consistency_errors_name_both_numbers() -> None:
    with pytest.raises(ValueError, match="3 rows but there are 2 sequences"):
        HiddenStates(rows([1.0, 2.0, 3.0]), meta(0, 1))
    with pytest.raises(ValueError, match="has 1 rows but hidden_states has 2"):
        HiddenStates(rows([1.0, 2.0]), meta(0, 1), rows([1.0]))
    hs = HiddenStates(rows([1.0]), meta(0))
    with pytest.raises(ValueError, match="2 rows for 1 sequences"):
        hidden_states_update(hs, rows([1.0, 2.0]), meta(1))
    with pytest.raises(ValueError, match=r"no hidden state for seq ids \[7\]"):
        hidden_states_prune(hs, meta(0, 7))
    anonymous = HiddenStates(rows([1.0]))  # no seq ids: fine to hold, not to prune
    with pytest.raises(ValueError, match="1 rows but 0 known seq ids"):
        hidden_states_prune(anonymous, meta(0))


# -- ExecuteModelRequest ---------------------------------------------------------------------------
def test_multi_step_properties() -> None:
    metas = meta(0, 1)
    for m in metas:
        m.state = SequenceGroupState(num_steps=2)
    req = ExecuteModelRequest(metas)
    assert (is_first_multi_step(req), is_last_step(req), current_step(req)) == (True, False, 0)
    finish_step(metas[0])
    assert (is_first_multi_step(req), is_last_step(req), current_step(req)) == (False, True, 1)
    with pytest.raises(ValueError, match="non-empty seq_group_metadata_list"):
        current_step(ExecuteModelRequest([]))


def test_clone_copies_what_a_proposer_may_mutate() -> None:
    hidden = HiddenStates(rows([1.0, 2.0]), meta(0, 1), rows([-1.0, -2.0]))
    req = ExecuteModelRequest(meta(0, 1), blocks_to_copy=[(1, 2)], num_lookahead_slots=4,
                              running_queue_size=3, previous_hidden_states=hidden, num_steps=1,
                              spec_step_idx=2, finished_requests_ids=["gone"],
                              last_sampled_token_ids=torch.tensor([[5], [6]]))
    new_metas = meta(1)
    clone = clone_request(req, new_metas)
    assert clone.seq_group_metadata_list is new_metas
    assert (clone.num_lookahead_slots, clone.running_queue_size, clone.spec_step_idx) == (4, 3, 2)
    assert clone.blocks_to_copy == [(1, 2)] and clone.finished_requests_ids == ["gone"]

    clone.blocks_to_copy.append((3, 4))
    clone.finished_requests_ids.append("also-gone")
    clone.last_sampled_token_ids[0, 0] = 99
    expand_with_bonus_tokens(clone.previous_hidden_states, {0})
    assert req.blocks_to_copy == [(1, 2)] and req.finished_requests_ids == ["gone"]
    assert req.last_sampled_token_ids.tolist() == [[5], [6]]
    assert req.previous_hidden_states.seq_ids == [0, 1]
    assert values(req.previous_hidden_states.hidden_states) == [1.0, 2.0]
    assert clone.previous_hidden_states.seq_ids == [0, 0, 1]
