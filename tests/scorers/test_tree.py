"""scorers/tree.py: the tree mask, depth positions and KV compaction on hand-written parent arrays.

The proof: node i's logits from the one tree forward equal a plain forward of "prefix + the path to node
i", and after compacting an accepted path into place, decoding on equals decoding that path directly.
"""

import random

import pytest
import torch

from scorers.tree import TreeScorer, _tree_batch_tensors, tree_batch
from specdec.engine import ForwardBatch
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_random_llama
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.sequence import SequenceData
from specdec.datamodel.metadata import SequenceGroupMetadata
from specdec.spec_decode.proposer import TreeProposals

T = torch.tensor
#   pending
#    /   \
#   0     1        parents [-1, -1, 0, 0, 2]: nodes 0 and 1 follow the pending token,
#  / \             2 and 3 follow node 0, 4 follows node 2 (depths 1, 1, 2, 2, 3)
# 2   3
# |
# 4
PARENTS_A = [-1, -1, 0, 0, 2]
TOKENS_A = [11, 12, 13, 14, 15]
PARENTS_B = [-1, 0]  # a chain of two: the tree mask must reduce to a causal one
TOKENS_B = [21, 22]
PROMPT_A = rand_tokens(7, seed=5)  # the last token is the pending one
PROMPT_B = rand_tokens(4, seed=6)


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny ops: intra-op threads only contend on the 2 shared cores (see tests/spec_decode/conftest.py)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def engine():
    return tiny_random_llama(0, num_slots=4, max_model_len=64)


def proposals() -> TreeProposals:
    pad = [-1, -1, -1]  # row B has 2 real nodes of N = 5
    return TreeProposals(token_ids=T([TOKENS_A, TOKENS_B + pad]), parents=T([PARENTS_A, PARENTS_B + pad]),
                         num_nodes=T([5, 2]))


def path_to(parents: list[int], tokens: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


def fresh(engine, tokens: list[int]) -> torch.Tensor:
    """[len, V] logits of a plain causal forward of ``tokens`` in a scratch slot."""
    slot = engine.allocate_slot()
    try:
        return engine.forward(ForwardBatch(T(tokens), [slot], [len(tokens)])).logits
    finally:
        engine.free_slot(slot)


def test_tree_batch_mask_and_positions():
    par_r, tok_r = proposals().with_root(T([PROMPT_A[-1], PROMPT_B[-1]]))
    assert par_r.tolist() == [[-1, 0, 0, 1, 1, 3], [-1, 0, 1, 0, 0, 0]]  # root-inclusive: +1, root = 0
    tb = tree_batch(par_r, tok_r, T([5, 2]), T([7, 4]))
    assert tb.query_lens == [6, 3]
    # positions = base_len - 1 + depth: the two depth-1 siblings share position 7, not 7 and 8
    assert tb.positions.tolist() == [6, 7, 7, 8, 8, 9, 3, 4, 5]
    assert tb.token_ids.tolist() == [PROMPT_A[-1], *TOKENS_A, PROMPT_B[-1], *TOKENS_B]
    expected = T([[1, 0, 0, 0, 0, 0],  # pending token: itself (plus the cached prefix, always visible)
                  [1, 1, 0, 0, 0, 0],  # node 0: pending + itself
                  [1, 0, 1, 0, 0, 0],  # node 1: NOT its sibling node 0
                  [1, 1, 0, 1, 0, 0],  # node 2: pending, node 0, itself
                  [1, 1, 0, 0, 1, 0],  # node 3: not its sibling node 2
                  [1, 1, 0, 1, 0, 1],  # node 4: pending, 0, 2, itself
                  [1, 0, 0, 0, 0, 0],  # row B (a chain): causal, padded to max_q = 6 columns
                  [1, 1, 0, 0, 0, 0],
                  [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(tb.tree_mask, expected)


def test_tree_batch_from_lists_equals_the_tensor_path():
    """A step's few nodes take the list path (tree_batch); the kernels' mask path must give the same batch."""
    g = random.Random(0)
    for _ in range(200):
        B, M = g.randint(1, 6), g.randint(1, 16)
        par, nn = [], []
        for _ in range(B):
            n = g.randint(0, M - 1)
            nn.append(n)  # real nodes: a parent before each; padding: -1 or 0 (what with_root leaves)
            par.append([-1] + [g.randint(0, i - 1) for i in range(1, n + 1)] + [g.choice([-1, 0]) for _ in range(M - 1 - n)])
        args = (T(par), torch.randint(0, 100, (B, M)), T(nn), torch.randint(1, 50, (B,)))
        a, b = tree_batch(*args), _tree_batch_tensors(*args, kernel="torch")
        assert a.query_lens == b.query_lens
        for x, y in ((a.token_ids, b.token_ids), (a.positions, b.positions), (a.tree_mask, b.tree_mask)):
            assert x.dtype == y.dtype and torch.equal(x, y)


def request(engine) -> tuple[ExecuteModelRequest, dict[int, int]]:
    """Two running sequences whose target slots hold every token but the pending one."""
    metas, slot_of = [], {}
    for seq_id, prompt in ((0, PROMPT_A), (1, PROMPT_B)):
        slot_of[seq_id] = slot = engine.allocate_slot()
        engine.forward(ForwardBatch(T(prompt[:-1]), [slot], [len(prompt) - 1]))
        metas.append(SequenceGroupMetadata(request_id=str(seq_id), is_prompt=False,
                                           seq_data={seq_id: SequenceData.from_seqs(prompt)},
                                           sampling_params=SamplingParams(temperature=0.0)))
    return ExecuteModelRequest(seq_group_metadata_list=metas, num_lookahead_slots=3), slot_of


def test_node_logits_equal_the_path_forward(engine):
    req, slot_of = request(engine)
    scores = TreeScorer(engine, slot_of).score_proposals(req, proposals())
    assert scores.logits.shape == (2, 6, 512) and scores.hidden_states.shape == (2, 6, 64)
    for b, (prompt, par, tok) in enumerate(((PROMPT_A, PARENTS_A, TOKENS_A), (PROMPT_B, PARENTS_B, TOKENS_B))):
        torch.testing.assert_close(scores.logits[b, 0], fresh(engine, prompt)[-1], atol=1e-4, rtol=1e-4)
        for i in range(len(par)):
            ref = fresh(engine, prompt + path_to(par, tok, i))[-1]
            torch.testing.assert_close(scores.logits[b, i + 1], ref, atol=1e-4, rtol=1e-4,
                                       msg=f"row {b} node {i}: tree logits != path logits")
        # padded rows repeat the last real row
        assert torch.equal(scores.logits[b, len(par) + 1 :], scores.logits[b, len(par)].expand(5 - len(par), -1))
    assert [engine.seq_len(s) for s in slot_of.values()] == [6 + 6, 3 + 3]  # pending + nodes appended


def test_scorer_refuses_a_stale_slot(engine):
    req, slot_of = request(engine)
    engine.rollback(slot_of[1], 1)
    with pytest.raises(ValueError, match="holds 1 tokens, expected 3"):
        TreeScorer(engine, slot_of).score_proposals(req, proposals())


@pytest.mark.parametrize("accepted", [[0, 2, 4], [1], [0, 3], []])
def test_compaction_then_decoding_equals_the_path(engine, accepted):
    """Accept a path of row A, compact it to base_len, decode 2 more tokens: the logits must equal a plain
    forward of prompt + path. [1] moves a depth-1 node from cache index base (after node 0) into place;
    [0, 3] skips sibling node 2; [] keeps only the pending token."""
    req, slot_of = request(engine)
    TreeScorer(engine, slot_of).score_proposals(req, proposals())
    base, slot = len(PROMPT_A), slot_of[0]
    src = T([base - 1 + i + 1 for i in accepted], dtype=torch.long)  # node i sits at base - 1 + (i + 1)
    engine.compact(slot, src, base)
    assert engine.seq_len(slot) == base + len(accepted)
    path = [TOKENS_A[i] for i in accepted]
    nxt = [77, 78]
    got = engine.forward(ForwardBatch(T(nxt), [slot], [2])).logits
    ref = fresh(engine, PROMPT_A + path + nxt)[-2:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # the path's parents must be consistent with the tree, or this test would prove nothing
    assert all(PARENTS_A[b] == a for a, b in zip([-1] + accepted, accepted))
