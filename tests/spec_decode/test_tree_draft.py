"""proposers/tree_draft.py: EAGLE-2's dynamic tree (expansion, reranking, budget) and the draft model's
tree KV (re-feed with the ancestor mask, compaction of the accepted path, recovery without it)."""

import math

import pytest
import torch

from proposers.dynamic_tree import CandidateTree, build_dynamic_tree
from proposers.tree_draft import TreeDraftProposer
from specdec.engine import ForwardBatch
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_random_llama
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from specdec.tree import TreeShape

T = torch.tensor
LOG = math.log


def markov_expand(table: dict[int, list[float]], V: int):
    """An ``expand`` whose draft log-probs after a node depend only on the node's token."""
    calls = []

    def expand(cands: CandidateTree, frontiers: list[torch.Tensor]) -> torch.Tensor:
        calls.append([f.tolist() for f in frontiers])
        tok = cands.token_ids.gather(1, frontiers[-1])  # [B, k]
        rows = [[table.get(t, [1.0 / V] * V) for t in row] for row in tok.tolist()]
        return torch.tensor(rows).log()

    return expand, calls


def test_hand_computed_tree():
    # root: P(0)=.5, P(1)=.32 -> depth 1 = {0, 1}. After 0: P(2)=.6, P(1)=.2; after 1: P(0)=.7, P(1)=.15.
    # Cumulative: 0:.5, 1:.32, 0->2:.30, 0->1:.10, 1->0:.224, 1->1:.048 (candidates 0..5 in that order).
    root = T([[0.5, 0.32, 0.13, 0.05]]).log()
    expand, calls = markov_expand({0: [0.1, 0.2, 0.6, 0.1], 1: [0.7, 0.15, 0.1, 0.05]}, 4)
    tree, keep = build_dynamic_tree(root, expand, TreeShape(depth=2, topk=2, budget=4))
    assert calls == [[[[0, 1]]]]  # one expansion, of both depth-1 nodes
    assert keep.tolist() == [[0, 1, 2, 4]]  # the best 4 by cumulative prob: .5, .32, .30, .224
    assert tree.token_ids.tolist() == [[0, 1, 2, 0]] and tree.parents.tolist() == [[-1, -1, 0, 1]]
    assert tree.draft_probs is None  # deterministic top-k: verified as one-hot drafts
    tree, keep = build_dynamic_tree(root, markov_expand({0: [0.1, 0.2, 0.6, 0.1], 1: [0.7, 0.15, 0.1, 0.05]}, 4)[0],
                                    TreeShape(depth=2, topk=2, budget=3))
    assert tree.token_ids.tolist() == [[0, 1, 2]] and tree.parents.tolist() == [[-1, -1, 0]]
    # depth 3: the next frontier is the best 2 of depth 2 (candidates 2 and 4), not all four
    expand, calls = markov_expand({0: [0.1, 0.2, 0.6, 0.1], 1: [0.7, 0.15, 0.1, 0.05]}, 4)
    build_dynamic_tree(root, expand, TreeShape(depth=3, topk=2, budget=8))
    assert calls[1] == [[[0, 1]], [[2, 4]]]


@pytest.mark.parametrize("depth, topk, budget", [(4, 1, 10), (3, 2, 5), (5, 3, 20), (2, 4, 100)])
def test_tree_invariants(depth, topk, budget):
    """Random draft: every kept node's ancestors are kept (ancestor-closed), nodes are topological, the
    kept set is the best ``budget`` by cumulative log-prob, depth <= depth, topk=1 is the greedy chain."""
    V, B = 16, 3
    g = torch.Generator().manual_seed(depth * 10 + topk)
    table = {t: torch.softmax(torch.randn(V, generator=g) * 2, -1).tolist() for t in range(V)}
    root = torch.log_softmax(torch.randn(B, V, generator=g) * 2, -1)
    tree, keep = build_dynamic_tree(root, markov_expand(table, V)[0], TreeShape(depth, topk, budget))
    n_cands = topk + (depth - 1) * topk * topk
    N = min(budget, n_cands)
    assert tree.token_ids.shape == (B, N) and tree.num_nodes.tolist() == [N] * B
    for b in range(B):
        par, tok = tree.parents[b].tolist(), tree.token_ids[b].tolist()
        score, depths = [], []
        for i, p in enumerate(par):
            assert -1 <= p < i
            prev = root[b] if p < 0 else torch.tensor(table[tok[p]]).log()
            score.append((0.0 if p < 0 else score[p]) + float(prev[tok[i]]))
            depths.append(1 if p < 0 else depths[p] + 1)
        assert max(depths) <= depth
        children = [[j for j, p in enumerate(par) if p == i] for i in range(-1, N)]
        assert all(len(c) <= topk for c in children)
        # kept = the best N of every candidate EAGLE-2 generates
        best = sorted(_all_scores(root[b], table, depth, topk), reverse=True)[:N]
        assert len(best) == N
        torch.testing.assert_close(T(sorted(score, reverse=True)), T(best), atol=1e-4, rtol=0)
    if topk == 1:  # the chain of greedy draft tokens
        t = root.argmax(-1).tolist()
        for b in range(B):
            chain = [t[b]]
            while len(chain) < min(depth, budget):
                chain.append(int(torch.tensor(table[chain[-1]]).argmax()))
            assert tree.token_ids[b].tolist() == chain and tree.parents[b].tolist() == list(range(-1, len(chain) - 1))


def _all_scores(root, table, depth, topk):
    """Scores of every candidate EAGLE-2 generates (same expansion rule, plain Python)."""
    lv, lt = root.topk(topk)
    frontier = [(float(s), int(t)) for s, t in zip(lv, lt)]
    out = [s for s, _ in frontier]
    for _ in range(depth - 1):
        new = []
        for s, t in frontier:
            v, i = torch.tensor(table[t]).log().topk(topk)
            new += [(s + float(a), int(c)) for a, c in zip(v, i)]
        out += [s for s, _ in new]
        frontier = sorted(new, key=lambda x: -x[0])[:topk]
    return out


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
