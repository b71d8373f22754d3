"""specdec/spec_decode/proposer.py: the plug-in contract's defaults. ProposeBatch.feature_rows hands each
sequence its own rows in batch order (and says what to declare when none were threaded); the default
``accepted`` keeps the prefix of the path that sits where a chain would have cached it; the default
``restore`` frees (exact for a stateless proposer); FeatureSpec's defaults are the last layer, one row."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from specdec.datamodel.hidden_states import HiddenStates
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, Proposer, ProposeBatch


class Recorder(Proposer):
    def __init__(self) -> None:
        super().__init__(None, SimpleNamespace())
        self.calls: list[tuple] = []

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        raise AssertionError("not called")

    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        self.calls.append(("verified", seq_id, num_valid_tokens))

    def free(self, seq_id: int) -> None:
        self.calls.append(("free", seq_id))


def batch(seq_ids, hidden=None) -> ProposeBatch:
    n = len(seq_ids)
    return ProposeBatch(seq_ids=seq_ids, token_ids=[[1, 2]] * n, k=2, sampling_params=[None] * n,
                        generators=[None] * n, hidden_states=hidden)


def test_feature_rows_are_each_sequences_rows_in_batch_order():
    feats = torch.arange(10.0).reshape(5, 2)
    hs = HiddenStates(feats, _seq_ids=[3, 3, 5, 5, 5])
    rows = batch([5, 3], hs).feature_rows()  # the batch order, not the rows' order
    assert [r.tolist() for r in rows] == [feats[2:5].tolist(), feats[0:2].tolist()]


def test_feature_rows_without_hidden_states_say_to_declare_a_feature_spec():
    with pytest.raises(ValueError, match=r"no hidden states were threaded; declare a FeatureSpec"):
        batch([0]).feature_rows()


@pytest.mark.parametrize("nodes, kept", [
    ([0, 1, 2], 3),  # a chain accepted in full: every cached draft sits where it was drafted
    ([], 0),  # nothing accepted: only the committed tokens
    ([0, 2], 1),  # a tree path: node 2 was cached at base+2, but lands at base+1 -> only node 0 stays
    ([1], 0),  # the path starts at a later sibling: nothing cached sits in place
])
def test_default_accepted_keeps_the_prefix_of_the_path_in_place(nodes, kept):
    p = Recorder()
    p.accepted(7, 10, nodes)
    assert p.calls == [("verified", 7, 10 + kept)]


def test_default_snapshot_is_nothing_and_restore_frees():
    p = Recorder()
    snap = p.snapshot([4, 6])
    assert snap is None
    p.restore([4, 6], snap)
    assert p.calls == [("free", 4), ("free", 6)]
    assert Recorder.check_config({"method": "x"}) is None  # accepts any config unless overridden


def test_feature_spec_defaults_and_is_frozen():
    spec = FeatureSpec()
    assert spec.layers == () and spec.history == 1 and Proposer.features is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.history = None
