"""proposers/tree_draft.py: the draft model's tree KV (re-feed with the ancestor mask, compaction of the
accepted path, recovery without it); every tree checked against one built from fresh causal forwards."""

import pytest
import torch

from proposers.dynamic_tree import build_dynamic_tree
from proposers.tree_draft import TreeDraftProposer
from specdec.engine import ForwardBatch
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_random_llama
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from specdec.spec_decode.proposer import TreeShape

T = torch.tensor

# ------------------------------------------------------------------ the draft model's tree KV

PROMPTS = [rand_tokens(9, seed=21), rand_tokens(5, seed=22)]


def make_proposer(seed: int = 3) -> TreeDraftProposer:
    target = tiny_random_llama(0, num_slots=4, max_model_len=64)
    draft = tiny_random_llama(seed, num_slots=4, max_model_len=64)
    return TreeDraftProposer(target, SpeculativeConfig(method="tree_draft", scorer="tree", options={"engine": draft}))


def batch(seqs: list[list[int]]) -> ProposeBatch:
    return ProposeBatch(seq_ids=list(range(len(seqs))), token_ids=seqs, k=3, sampling_params=[None] * len(seqs),
                        generators=[None] * len(seqs))


def fresh_logprobs(engine, tokens: list[int]) -> torch.Tensor:
    slot = engine.allocate_slot()
    try:
        lg = engine.forward(ForwardBatch(T(tokens), [slot], [len(tokens)], logits_indices=T([len(tokens) - 1]))).logits
        return torch.log_softmax(lg[0].float(), -1)
    finally:
        engine.free_slot(slot)


def reference_tree(engine, prompt: list[int], shape: TreeShape):
    """The same tree with every expansion computed by a fresh causal forward of prompt + path."""

    def expand(cands, frontiers):
        out = []
        for b, row in enumerate(frontiers[-1].tolist()):
            rows = []
            for c in row:
                path, i = [], c
                while i >= 0:
                    path.append(int(cands.token_ids[b, i]))
                    i = int(cands.parents[b, i])
                rows.append(fresh_logprobs(engine, prompt + path[::-1]))
            out.append(torch.stack(rows))
        return torch.stack(out)

    return build_dynamic_tree(fresh_logprobs(engine, prompt)[None], expand, shape)[0]


def test_refeed_mask_and_positions_match_fresh_forwards():
    prop = make_proposer()
    shape = TreeShape(depth=4, topk=3, budget=12)
    tree = prop.propose_tree(batch(PROMPTS), shape)
    for b, prompt in enumerate(PROMPTS):
        ref = reference_tree(prop.engine, prompt, shape)
        assert tree.token_ids[b].tolist() == ref.token_ids[0].tolist()
        assert tree.parents[b].tolist() == ref.parents[0].tolist()
        # the slot holds the prompt + the (depth-1)*topk expanded nodes of the last re-feed
        assert prop.engine.seq_len(prop.slot_of[b]) == len(prompt) + 3 * 3


def _path_to(tree, b: int, node: int | None) -> list[int]:
    par, path = tree.parents[b].tolist(), []
    while node is not None and node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1]


@pytest.mark.parametrize("which", ["none", "first", "deepest"])
def test_accepted_compacts_the_path_and_decoding_continues_exactly(which):
    """Accept nothing, the first depth-1 node, or the path to the deepest node (a depth-4 leaf: its
    ancestors were expanded, so their draft KV is compacted into place; the leaf itself never was)."""
    prop = make_proposer()
    tree = prop.propose_tree(batch(PROMPTS), TreeShape(depth=4, topk=2, budget=14))  # every candidate
    b, prompt = 0, PROMPTS[0]
    depths = tree.parents.new_zeros(14)
    for i, p in enumerate(tree.parents[b].tolist()):
        depths[i] = 1 if p < 0 else depths[p] + 1
    node = {"none": None, "first": 0, "deepest": int(depths.argmax())}[which]
    nodes = _path_to(tree, b, node)
    assert len(nodes) == {"none": 0, "first": 1, "deepest": 4}[which]
    toks = [int(tree.token_ids[b, i]) for i in nodes]
    n_kv = min(len(nodes), 3)  # nodes at depth <= depth-1 on an accepted path were expanded (fed)
    prop.accepted(b, len(prompt), nodes)
    slot = prop.slot_of[b]
    assert prop.engine.seq_len(slot) == len(prompt) + n_kv and prop._held[b] == prompt + toks[:n_kv]
    # decoding on from the compacted slot (the catch-up feeds the rest) equals a fresh forward
    rest = toks[n_kv:] + [99]
    got = prop.engine.forward(ForwardBatch(T(rest), [slot], [len(rest)])).logits[-1]
    torch.testing.assert_close(torch.log_softmax(got.float(), -1), fresh_logprobs(prop.engine, prompt + toks + [99]),
                               atol=1e-4, rtol=1e-4)


def test_a_missed_accepted_costs_a_recompute_not_a_wrong_tree():
    """Two tree steps without accepted() in between: the stale tree KV must be dropped."""
    prop = make_proposer()
    shape = TreeShape(depth=3, topk=2, budget=6)
    prop.propose_tree(batch(PROMPTS), shape)
    longer = [PROMPTS[0] + [7, 8], PROMPTS[1] + [9]]
    tree = prop.propose_tree(batch(longer), shape)
    for b, prompt in enumerate(longer):
        ref = reference_tree(prop.engine, prompt, shape)
        assert tree.token_ids[b].tolist() == ref.token_ids[0].tolist(), f"row {b}"
