"""specdec/interfaces.py: SpeculativeProposals (checks, chain construction, row scatter, the chain views
and the root-inclusive layout), SpeculativeScores' derived views, Verdict.num_accepted and the
verifier's default ``from_config``. Hand-written tensors; the reason for each answer is beside it."""

from types import SimpleNamespace

import pytest
import torch

from specdec.interfaces import SpeculativeProposals, SpeculativeScores, SpeculativeVerifier, Verdict
from specdec.spec_decode.proposer import TreeProposals

T = torch.tensor


def test_tree_proposals_refuse_a_parent_after_its_child():
    with pytest.raises(ValueError, match="row 0 node 1 has parent 1"):
        TreeProposals(token_ids=T([[5, 6]]), parents=T([[-1, 1]]), num_nodes=T([2]))


def test_shapes_are_checked_naming_both():
    with pytest.raises(ValueError, match=r"token_ids \(2, 3\), parents \(2, 2\), num_nodes \(2,\)"):
        SpeculativeProposals(T([[1, 2, 3], [4, 5, 6]]), T([[-1, 0], [-1, 0]]), T([3, 3]))
    with pytest.raises(ValueError, match=r"draft_probs \(2, 2, 8\); expected \[2, 3, V\]"):
        SpeculativeProposals(T([[1, 2, 3], [4, 5, 6]]), T([[-1, 0, 1]] * 2), T([3, 3]), torch.zeros(2, 2, 8))


def test_a_real_node_needs_a_token_and_padding_is_not_checked():
    with pytest.raises(ValueError, match="row 1 node 0 has parent -1 and token -1"):
        SpeculativeProposals(T([[1, 2], [-1, -1]]), T([[-1, 0], [-1, 0]]), T([2, 1]))
    # row 1 has one real node: node 1 (token -1, parent 5) is padding and may hold anything
    SpeculativeProposals(T([[1, 2], [3, -1]]), T([[-1, 0], [-1, 5]]), T([2, 1]))


def test_chain_has_parents_i_minus_1_and_the_seed_views():
    tok = T([[7, 8, 9], [4, -1, -1]])
    q = torch.rand(2, 3, 16)
    p = SpeculativeProposals.chain(tok, q, T([3, 1]))
    assert p.parents.tolist() == [[-1, 0, 1], [-1, 0, 1]]
    assert p.is_chain and not p.no_proposals
    assert p.proposal_token_ids is p.token_ids and p.proposal_probs is q and p.proposal_lens.tolist() == [3, 1]


def test_a_branching_tree_is_not_a_chain():
    # pending -> {0, 1}: node 1's parent is -1, not 0
    p = SpeculativeProposals(T([[5, 6]]), T([[-1, -1]]), T([2]))
    assert not p.is_chain
    # the same row with node 1 as padding is a chain of one
    assert SpeculativeProposals(T([[5, -1]]), T([[-1, -1]]), T([1])).is_chain


def test_empty_has_no_nodes():
    p = SpeculativeProposals.empty(3)
    assert p.token_ids.shape == (3, 0) and p.num_nodes.tolist() == [0, 0, 0]
    assert p.no_proposals and p.is_chain


def test_scatter_rows_places_rows_and_leaves_the_others_without_nodes():
    q = torch.rand(2, 2, 5)
    p = SpeculativeProposals(T([[1, 2], [3, -1]]), T([[-1, 0], [-1, -1]]), T([2, 1]), q, noise_width=4)
    s = p.scatter_rows([1, 3], 4)
    assert s.token_ids.tolist() == [[-1, -1], [1, 2], [-1, -1], [3, -1]]
    assert s.parents.tolist() == [[-1, -1], [-1, 0], [-1, -1], [-1, -1]]
    assert s.num_nodes.tolist() == [0, 2, 0, 1]
    assert torch.equal(s.draft_probs[[1, 3]], q) and not s.draft_probs[[0, 2]].any()
    assert s.noise_width == 4  # a seeded row's draws stay fixed wherever it sits
    assert SpeculativeProposals(T([[1]]), T([[-1]]), T([1])).scatter_rows([0], 2).draft_probs is None


def test_with_root_is_the_root_inclusive_layout():
    # pending token 42; drafts: 0 -> child of pending, 1 -> child of 0, 2 -> child of pending
    p = SpeculativeProposals(T([[5, 6, 7]]), T([[-1, 0, -1]]), T([3]), torch.full((1, 3, 4), 0.25))
    parents, tokens = p.with_root(T([42]))
    assert parents.tolist() == [[-1, 0, 1, 0]]  # node 0 = the pending token, draft i = node i+1
    assert tokens.tolist() == [[42, 5, 6, 7]]
    q = p.draft_probs_with_root()
    assert q.shape == (1, 4, 4) and not q[0, 0].any() and torch.equal(q[0, 1:], p.draft_probs[0])
    assert SpeculativeProposals(T([[5]]), T([[-1]]), T([1])).draft_probs_with_root() is None


def test_scores_views_derive_from_the_raw_logits():
    logits = torch.randn(2, 3, 6)
    s = SpeculativeScores(logits, torch.zeros(2, 3, 4))
    torch.testing.assert_close(s.logprobs, torch.log_softmax(logits, -1))
    torch.testing.assert_close(s.probs, torch.softmax(logits, -1))
    assert torch.equal(s.token_ids, logits.argmax(-1))


def test_verdict_num_accepted_excludes_the_root():
    v = Verdict(path=T([[0, 1, 2, -1], [0, -1, -1, -1], [0, 2, 3, 4]]), out=T([[5, 6, 9, -1], [9, -1, -1, -1],
                                                                               [5, 6, 7, 9]]))
    assert v.num_accepted.tolist() == [2, 0, 3]


def test_verifier_from_config_passes_the_kernel():
    class Kernelled(SpeculativeVerifier):
        def __init__(self, kernel: str) -> None:
            self.kernel = kernel

        def verify_proposals(self, *args):
            raise AssertionError("not called")

    assert Kernelled.from_config(SimpleNamespace(kernel="triton")).kernel == "triton"


def test_logit_stats_describe_only_the_logits_they_were_taken_from():
    """SpeculativeScores.current_logit_stats: the engine's row facts hold while ``logits`` is the tensor they were
    taken from, unedited; a replaced tensor or an in-place edit (fault injection, the worker zeroing a bad row)
    makes the consumers read the logits instead."""
    from specdec.engine.interface import LogitStats

    logits = torch.randn(1, 3, 10)
    stats = LogitStats(logits.argmax(-1), torch.logsumexp(logits, -1), torch.ones(1, 3, dtype=torch.bool), logits,
                       logits._version)
    s = SpeculativeScores(logits=logits, hidden_states=torch.zeros(1, 3, 4), logit_stats=stats)
    assert s.current_logit_stats() is stats
    logits[0, 1] = float("nan")
    assert s.current_logit_stats() is None
    s2 = SpeculativeScores(logits=logits.clone(), hidden_states=torch.zeros(1, 3, 4), logit_stats=stats)
    assert s2.current_logit_stats() is None


def test_is_chain_reads_the_same_in_lists_and_in_tensors():
    # B * N <= 256 on the CPU takes lists; a wide one takes the tensor ops: both answer alike
    for tok, par, n, want in (([[5, 6, 7]], [[-1, 0, 1]], [3], True), ([[5, 6, 7]], [[-1, 0, 0]], [3], False),
                              ([[5, 6, 7]], [[-1, 0, 0]], [2], True), ([[5, -1]], [[-1, -1]], [0], True)):
        small = SpeculativeProposals(T(tok), T(par), T(n))
        assert small.is_chain is want
        wide = SpeculativeProposals(T(tok).repeat(100, 1), T(par).repeat(100, 1), T(n).repeat(100))
        assert wide.is_chain is want


def test_nonfinite_rows_from_the_engine_stats_are_taken_once_and_name_the_bad_row():
    from specdec.engine.interface import LogitStats

    logits = torch.zeros(2, 3, 4)
    stats = LogitStats(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), T([[True, True, True],
                                                                                [True, False, True]]), logits, logits._version)
    s = SpeculativeScores(logits=logits, hidden_states=torch.zeros(2, 3, 1), logit_stats=stats)
    assert s.nonfinite_rows.tolist() == [False, True]
    assert s.nonfinite_rows is s.nonfinite_rows  # computed once per step
    logits[0, 0, 0] = float("nan")  # edited after the stats: they no longer describe it, the logits are read
    assert s.nonfinite_rows.tolist() == [True, False]
