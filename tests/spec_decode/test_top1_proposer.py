"""specdec/spec_decode/top1_proposer.py: the per-step edge cases of proposing, around scripted proposers
(no model): which rows draft (k per row near max_model_len, disable_by_batch_size, rows without feature
rows for a proposer with a FeatureSpec), what the proposer is handed (only those rows; ``read`` lists
them), and how its output comes back (short or empty proposals -> num_nodes, [B, k] chains scattered to
their rows, a tree's width checked against the budget)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.datamodel.hidden_states import ExecuteModelRequest, HiddenStates
from specdec.interfaces import SpeculativeProposals
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import SequenceData, SequenceGroupState
from specdec.datamodel.metadata import SequenceGroupMetadata
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, Proposer, ProposeBatch
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.spec_decode.proposer import TreeProposer, TreeShape

T = torch.tensor
V = 16  # vocabulary of the scripted drafts
GREEDY = SamplingParams(temperature=0.0)


class Scripted(Proposer):
    """Returns ``script(batch)`` and keeps every batch it was handed."""

    def __init__(self, script=None, features: FeatureSpec | None = None) -> None:
        super().__init__(None, SimpleNamespace())
        self.script = script or (lambda b: DraftOutput(T([[10 + i] * b.k for i in range(len(b.seq_ids))]), None))
        self.features = features
        self.batches: list[ProposeBatch] = []

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        self.batches.append(batch)
        return self.script(batch)


class ScriptedTree(TreeProposer, Scripted):
    """A tree proposer: ``tree(batch, shape)`` gives its proposals; ``lookahead`` its own KV need."""

    def __init__(self, tree, lookahead: int | None = None) -> None:
        Scripted.__init__(self)
        self.tree, self.lookahead = tree, lookahead

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> SpeculativeProposals:
        self.batches.append(batch)
        return self.tree(batch, shape)

    def tree_lookahead(self, shape: TreeShape) -> int:
        return self.lookahead if self.lookahead is not None else super().tree_lookahead(shape)


def request(lens: list[int], seq_ids: list[int] | None = None, running_queue_size: int = 0,
            hidden: HiddenStates | None = None, params=None, generators=None) -> ExecuteModelRequest:
    """One decode step over sequences of ``lens`` tokens (prompt 2 tokens, the rest output; token i = i)."""
    seq_ids = seq_ids or list(range(len(lens)))
    metas = []
    for b, (sid, n) in enumerate(zip(seq_ids, lens)):
        toks = list(range(100 * b, 100 * b + n))
        metas.append(SequenceGroupMetadata(
            request_id=f"r{sid}", is_prompt=False, seq_data={sid: SequenceData.from_seqs(toks[:2], toks[2:])},
            sampling_params=(params or [GREEDY] * len(lens))[b],
            state=SequenceGroupState(generator=(generators or [None] * len(lens))[b])))
    return ExecuteModelRequest(seq_group_metadata_list=metas, num_lookahead_slots=3,
                               running_queue_size=running_queue_size, previous_hidden_states=hidden)


# ---------------------------------------------------------------------------------------------- which rows


def test_k_per_row_near_max_model_len():
    """k=3 scores k+1 = 4 tokens past a sequence: 16 + 4 <= 20 drafts, 17 + 4 > 20 does not."""
    prop = Scripted()
    top1 = Top1Proposer(prop, k=3, max_model_len=20, vocab_size=V)
    req = request([16, 17, 5])
    assert top1.seq_ks(req) == [3, 0, 3]
    out = top1.get_spec_proposals(req, set())
    assert [b.seq_ids for b in prop.batches] == [[0, 2]]  # the long row is not handed over
    assert out.num_nodes.tolist() == [3, 0, 3] and out.token_ids[1].tolist() == [-1, -1, -1]


def test_a_trees_need_is_its_budget_or_the_proposers_own_lookahead():
    shape = TreeShape(depth=2, topk=2, budget=6)
    assert Top1Proposer(ScriptedTree(None), 0, 100, V, shape=shape).need == 6  # the target scores budget + 1
    top1 = Top1Proposer(ScriptedTree(None, lookahead=9), 0, 20, V, shape=shape)
    assert top1.need == 9 and top1.k == 2  # k is the tree's depth
    assert top1.seq_ks(request([11, 12])) == [2, 0]  # 11 + 9 <= 20 < 12 + 9


def test_disable_by_batch_size_turns_the_whole_batch_off():
    prop = Scripted()
    top1 = Top1Proposer(prop, k=2, max_model_len=64, vocab_size=V, disable_by_batch_size=3)
    out = top1.get_spec_proposals(request([5, 6], running_queue_size=3), set())
    assert prop.batches == [] and out.drafted_seq_ids == []
    assert out.token_ids.shape == (2, 2) and out.no_proposals and out.is_chain
    assert top1.get_spec_proposals(request([5, 6], running_queue_size=2), set()).num_nodes.tolist() == [2, 2]


def test_rows_without_feature_rows_are_not_handed_to_a_feature_proposer():
    """A FeatureSpec proposer gets only the sequences with rows in previous_hidden_states, and only their
    rows; ``drafted_seq_ids`` lists the seq ids it was given (the worker then drops those rows as spent)."""
    prop = Scripted(features=FeatureSpec())
    top1 = Top1Proposer(prop, k=2, max_model_len=64, vocab_size=V)
    hs = HiddenStates(torch.arange(12.0).reshape(3, 4), _seq_ids=[7, 7, 9])  # seq 8 has no row
    out = top1.get_spec_proposals(request([5, 6, 7], seq_ids=[7, 8, 9], hidden=hs), set())
    (batch,) = prop.batches
    assert batch.seq_ids == [7, 9] and out.drafted_seq_ids == [7, 9]
    rows = batch.feature_rows()
    assert torch.equal(rows[0], hs.hidden_states[:2]) and torch.equal(rows[1], hs.hidden_states[2:])
    assert out.num_nodes.tolist() == [2, 0, 2]
    # without any hidden states nothing is handed over
    prop.batches.clear()
    out = top1.get_spec_proposals(request([5, 6], hidden=None), set())
    assert out.no_proposals and out.drafted_seq_ids == [] and prop.batches == []


def test_a_proposer_without_a_feature_spec_gets_no_hidden_states():
    prop = Scripted()
    top1 = Top1Proposer(prop, k=2, max_model_len=64, vocab_size=V)
    hs = HiddenStates(torch.zeros(2, 4), _seq_ids=[0, 1])
    out = top1.get_spec_proposals(request([5, 6], hidden=hs), set())
    assert prop.batches[0].hidden_states is None and out.drafted_seq_ids == [0, 1]


def test_the_batch_carries_tokens_params_generators_and_the_bonus_set():
    prop = Scripted()
    top1 = Top1Proposer(prop, k=3, max_model_len=64, vocab_size=V)
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.7, seed=1), GREEDY]
    top1.get_spec_proposals(request([4, 3], seq_ids=[5, 6], params=params, generators=[g, None]), {6})
    (b,) = prop.batches
    assert b.token_ids == [[0, 1, 2, 3], [100, 101, 102]] and b.k == 3
    assert b.sampling_params == params and b.generators[0] is g and b.generators[1] is None
    assert b.seq_ids_with_bonus_token_in_last_step == frozenset({6})


# ---------------------------------------------------------------------------------------------- chain output


def test_short_and_empty_proposals_become_num_nodes():
    """lens [2, 0, 3]: past a proposal's length the tokens become -1 and q zero, whatever was there."""
    q = torch.softmax(torch.randn(3, 3, V), -1)
    prop = Scripted(lambda b: DraftOutput(T([[4, 5, 6], [7, 8, 9], [1, 2, 3]]), q, lens=T([2, 0, 3])))
    out = Top1Proposer(prop, k=3, max_model_len=64, vocab_size=V).get_spec_proposals(request([5, 5, 5]), set())
    assert out.num_nodes.tolist() == [2, 0, 3]
    assert out.token_ids.tolist() == [[4, 5, -1], [-1, -1, -1], [1, 2, 3]]
    assert torch.equal(out.draft_probs[0, :2], q[0, :2]) and not out.draft_probs[0, 2].any()
    assert not out.draft_probs[1].any() and torch.equal(out.draft_probs[2], q[2])


def test_fewer_columns_than_k_are_padded_and_lens_clamped():
    """A proposer that drafts 2 columns where k=4 (lens None = every column; a len above the width is
    clamped to it)."""
    out = Top1Proposer(Scripted(lambda b: DraftOutput(T([[4, 5], [6, 7]]), None, lens=T([5, 1]))), 4, 64, V
                       ).get_spec_proposals(request([5, 5]), set())
    assert out.token_ids.tolist() == [[4, 5, -1, -1], [6, -1, -1, -1]] and out.num_nodes.tolist() == [2, 1]
    out = Top1Proposer(Scripted(lambda b: DraftOutput(T([[4, 5]]), None)), 4, 64, V).get_spec_proposals(
        request([5]), set())
    assert out.num_nodes.tolist() == [2] and out.draft_probs is None


def test_chain_output_is_b_by_k_and_scattered_back_to_its_rows():
    """Rows 1 and 3 are too long to draft: the proposer sees rows 0 and 2, and its two rows land there."""
    q = torch.softmax(torch.randn(2, 2, V), -1)
    prop = Scripted(lambda b: DraftOutput(T([[4, 5], [6, 7]]), q))
    out = Top1Proposer(prop, k=2, max_model_len=10, vocab_size=V).get_spec_proposals(request([5, 9, 6, 8]), set())
    assert out.token_ids.shape == (4, 2) and out.draft_probs.shape == (4, 2, V)
    assert out.token_ids.tolist() == [[4, 5], [-1, -1], [6, 7], [-1, -1]]
    assert out.num_nodes.tolist() == [2, 0, 2, 0] and out.is_chain
    assert out.parents.tolist() == [[-1, 0]] * 4
    assert torch.equal(out.draft_probs[[0, 2]], q) and not out.draft_probs[[1, 3]].any()


def test_a_chain_with_the_wrong_row_count_is_refused_naming_the_proposer():
    prop = Scripted(lambda b: DraftOutput(T([[4, 5]]), None))
    with pytest.raises(ValueError, match="Scripted.propose returned 1 rows for 2 sequences"):
        Top1Proposer(prop, 2, 64, V).get_spec_proposals(request([5, 5]), set())


# ---------------------------------------------------------------------------------------------- tree output


def tree_of(n: int):
    """Each row: n nodes, all children of the pending token."""
    return lambda b, shape: SpeculativeProposals(T([list(range(20, 20 + n))] * len(b.seq_ids)),
                                                 torch.full((len(b.seq_ids), n), -1), T([n] * len(b.seq_ids)))


def test_a_tree_within_the_budget_is_scattered_with_the_fixed_noise_width():
    shape = TreeShape(depth=2, topk=3, budget=4)
    prop = ScriptedTree(tree_of(3))
    out = Top1Proposer(prop, 0, 12, V, shape=shape).get_spec_proposals(request([5, 9, 6]), set())
    assert prop.batches[0].seq_ids == [0, 2]  # 9 + 4 > 12
    assert out.token_ids.tolist() == [[20, 21, 22], [-1, -1, -1], [20, 21, 22]]
    assert out.num_nodes.tolist() == [3, 0, 3] and out.noise_width == 5  # budget + 1


def test_a_trees_output_width_is_checked_against_the_budget():
    shape = TreeShape(depth=2, topk=3, budget=4)
    with pytest.raises(ValueError, match=r"ScriptedTree.propose_tree returned \(2, 5\) nodes for 2 sequences; "
                                         r"expected \[2, <= budget=4\]"):
        Top1Proposer(ScriptedTree(tree_of(5)), 0, 64, V, shape=shape).get_spec_proposals(request([5, 6]), set())
    one_row = lambda b, shape: tree_of(2)(SimpleNamespace(seq_ids=[0]), shape)
    with pytest.raises(ValueError, match=r"returned \(1, 2\) nodes for 2 sequences"):
        Top1Proposer(ScriptedTree(one_row), 0, 64, V, shape=shape).get_spec_proposals(request([5, 6]), set())


def test_no_drafting_row_still_gives_the_steps_shape():
    """Nothing drafts: a chain step is [B, k] of -1; a tree step is empty with the fixed noise width, so
    a seeded row is verified the same way whatever else the batch holds."""
    chain = Top1Proposer(Scripted(), 3, 8, V).get_spec_proposals(request([6, 7]), set())
    assert chain.token_ids.tolist() == [[-1] * 3] * 2 and chain.num_nodes.tolist() == [0, 0]
    tree = Top1Proposer(ScriptedTree(tree_of(2)), 0, 8, V, shape=TreeShape(2, 2, 4)).get_spec_proposals(
        request([6, 7]), set())
    assert tree.token_ids.shape == (2, 0) and tree.noise_width == 5
