"""proposers/dynamic_tree.py: EAGLE-2's dynamic tree (expansion, reranking, budget) from hand-written and
random draft log-probs, against a plain-Python enumeration of every candidate."""

import pytest
import torch

from proposers.dynamic_tree import CandidateTree, build_dynamic_tree
from specdec.spec_decode.proposer import TreeShape

T = torch.tensor


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


def markov_row(table: dict[int, list[float]], V: int):
    """The batch-1 ``.row`` form of :func:`markov_expand`'s expand (build_dynamic_tree's fast path)."""
    def row(tokens, parents, depths, fed):
        assert len(tokens) == len(parents) == len(depths) and all(0 <= c < len(tokens) for c in fed)
        front = fed[-row.k:]
        return torch.tensor([table.get(tokens[c], [1.0 / V] * V) for c in front]).log()

    return row


@pytest.mark.parametrize("depth, topk, budget", [(3, 3, 4), (3, 3, 6), (4, 2, 7), (2, 4, 100), (5, 3, 20), (3, 1, 3)])
@pytest.mark.parametrize("ties", [False, True])
def test_batch1_fast_path_builds_the_batched_tree(depth, topk, budget, ties):
    """At batch 1 an expand with a ``.row`` takes the list-bookkeeping path: the same tree and kept ids as the
    batched tensor path, ties included (probabilities quantised to a few levels make many equal scores)."""
    V = 12
    g = torch.Generator().manual_seed(depth * 100 + topk * 10 + budget)
    for trial in range(5):
        def dist():
            p = torch.softmax(torch.randn(V, generator=g) * 2, -1)
            return ((p * 4).round() + 1).div((p * 4).round().add(1).sum()).tolist() if ties else p.tolist()
        table = {t: dist() for t in range(V)}
        root = torch.tensor([dist()]).log()
        want_tree, want_keep = build_dynamic_tree(root, markov_expand(table, V)[0], TreeShape(depth, topk, budget))
        expand = markov_expand(table, V)[0]
        expand.row = markov_row(table, V)
        expand.row.k = min(topk, V)
        got_tree, got_keep = build_dynamic_tree(root, expand, TreeShape(depth, topk, budget))
        assert got_keep.tolist() == want_keep.tolist()
        assert got_tree.token_ids.tolist() == want_tree.token_ids.tolist()
        assert got_tree.parents.tolist() == want_tree.parents.tolist()
        assert got_tree.num_nodes.tolist() == want_tree.num_nodes.tolist()


def test_batch1_fast_path_refuses_a_pruned_parent_as_the_batched_path_does():
    V = 6
    table = {t: [float("nan")] * V for t in range(V)}
    root = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]]).log()
    expand = markov_expand(table, V)[0]
    expand.row = markov_row(table, V)
    expand.row.k = 2
    with pytest.raises(RuntimeError, match="parent was pruned"):
        build_dynamic_tree(root, expand, TreeShape(3, 2, 5))


@pytest.mark.parametrize("depth, topk, budget", [(3, 3, 6), (4, 2, 7), (3, 2, 5)])
@pytest.mark.parametrize("row_path", [False, True])
def test_ranked_prefix_is_the_tree_of_a_smaller_budget(depth, topk, budget, row_path):
    """build_ranked_tree's ranks: the nodes of rank < t are exactly the tree build_dynamic_tree gives at
    budget t (ties included), on the batched and the batch-1 path alike."""
    from proposers.dynamic_tree import build_ranked_tree

    V = 12
    g = torch.Generator().manual_seed(depth * 100 + topk * 10 + budget)
    for trial in range(4):
        def dist():
            p = torch.softmax(torch.randn(V, generator=g) * 2, -1)
            return ((p * 4).round() + 1).div((p * 4).round().add(1).sum()).tolist() if trial % 2 else p.tolist()
        table = {t: dist() for t in range(V)}
        root = torch.tensor([dist()]).log()

        def make():
            e = markov_expand(table, V)[0]
            if row_path:
                e.row = markov_row(table, V)
                e.row.k = min(topk, V)
            return e
        tree, keep, rank = build_ranked_tree(root, make(), TreeShape(depth, topk, budget))
        assert sorted(rank[0].tolist()) == list(range(tree.token_ids.shape[1]))
        for t in range(1, budget + 1):
            small, small_keep = build_dynamic_tree(root, make(), TreeShape(depth, topk, t))
            assert [c for c, r in zip(keep[0].tolist(), rank[0].tolist()) if r < t] == small_keep[0].tolist()


def test_best_first_orders_nodes_by_rank_keeping_parents_first():
    """best_first: each row's nodes by rank (a prefix is the row's best nodes), parents remapped, padding kept."""
    from proposers.dynamic_tree import best_first
    from specdec.spec_decode.proposer import TreeProposals

    # row 0: a (rank 0), b (rank 2), child of a: c (rank 1), child of c: d (rank 3); row 1: one node, padding
    tree = TreeProposals(torch.tensor([[10, 11, 12, 13], [20, -1, -1, -1]]),
                         torch.tensor([[-1, -1, 0, 2], [-1, -1, -1, -1]]), torch.tensor([4, 1]))
    out, rank = best_first(tree, torch.tensor([[0, 2, 1, 3], [0, 0, 0, 0]]))
    assert out.token_ids.tolist() == [[10, 12, 11, 13], [20, -1, -1, -1]]
    assert out.parents.tolist() == [[-1, 0, -1, 1], [-1, -1, -1, -1]]
    assert out.num_nodes.tolist() == [4, 1] and rank[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="prefix-closed"):
        best_first(tree, torch.tensor([[1, 2, 0, 3], [0, 0, 0, 0]]))
