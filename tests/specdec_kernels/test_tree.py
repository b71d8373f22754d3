"""specdec_kernels/tree.py: ancestor mask of a parent array and greedy longest-accepted-path."""

import torch

from specdec_kernels.tree import build_tree_mask_ref, tree_greedy_accept_ref

T = torch.tensor
#        0 (root)
#       / \
#      1   2
#      |   |
#      3   5
#      |
#      4
PARENTS = T([-1, 0, 0, 1, 3, 2])


def test_tree_mask_is_ancestors_or_self():
    expected = T([[1, 0, 0, 0, 0, 0],
                  [1, 1, 0, 0, 0, 0],
                  [1, 0, 1, 0, 0, 0],
                  [1, 1, 0, 1, 0, 0],
                  [1, 1, 0, 1, 1, 0],
                  [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(build_tree_mask_ref(PARENTS), expected)
    # batched parent arrays; a chain of 5 is a causal (lower-triangular) mask
    chain = T([-1, 0, 1, 2, 3])
    both = build_tree_mask_ref(torch.stack([chain, T([-1, 0, 0, 0, 0])]))
    assert torch.equal(both[0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert both[1].sum().item() == 5 + 4  # a star: self + root for each leaf


def test_tree_greedy_accept():
    tokens = T([[0, 5, 6, 7, 8, 1],  # node tokens; root's is ignored
                [0, 5, 6, 7, 8, 1],
                [0, 5, 6, 7, 8, 1]])
    argmax = T([[5, 7, 0, 8, 3, 0],  # root->5 (node 1), 1->7 (node 3), 3->8 (node 4): full path, then 3
                [6, 7, 1, 8, 3, 4],  # root->6 (node 2), 2->1 (node 5): path 0-2-5, then argmax[5] = 4
                [9, 7, 1, 8, 3, 4]])  # root->9 matches no child: nothing accepted, emit 9
    path, out = tree_greedy_accept_ref(PARENTS.expand(3, 6), tokens, argmax)
    assert path.tolist() == [[0, 1, 3, 4, -1, -1], [0, 2, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1]]
    assert out.tolist() == [[5, 7, 8, 3, -1, -1], [6, 1, 4, -1, -1, -1], [9, -1, -1, -1, -1, -1]]


def test_tree_tie_prefers_lowest_index():
    # both children of the root match at depth 1 only if tokens equal; use a star with equal depths
    parents = T([[-1, 0, 0]])
    tokens = T([[0, 4, 4]])  # two identical drafts at depth 1
    path, out = tree_greedy_accept_ref(parents, tokens, T([[4, 9, 8]]))
    assert path.tolist() == [[0, 1, -1]] and out.tolist() == [[4, 9, -1]]


def test_tree_mask_row_copy_equals_path_doubling_on_random_trees():
    """CPU topological trees take the row-copy path, anything else the path doubling: both give the walk up
    the parents (a non-topological relabelling of the same tree gives the relabelled mask)."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 17, 33):
        par = torch.full((3, n), -1, dtype=torch.long)
        for i in range(1, n):
            par[:, i] = torch.randint(0, i, (3,), generator=g)
        walk = torch.zeros(3, n, n, dtype=torch.bool)
        for b in range(3):
            for i in range(n):
                j = i
                while j >= 0:
                    walk[b, i, j] = True
                    j = int(par[b, j])
        assert torch.equal(build_tree_mask_ref(par), walk)
        if n > 2:  # reverse the labels of the nodes: parents now come after their children (doubling path)
            rev = torch.arange(n - 1, -1, -1)
            rpar = torch.where(par[:, rev] >= 0, n - 1 - par[:, rev], par[:, rev])
            assert torch.equal(build_tree_mask_ref(rpar), walk[:, rev][:, :, rev])


def test_tree_greedy_accept_list_walk_equals_tensor_ops_on_random_trees():
    """Small CPU trees are walked in Python (specdec_kernels.tree._greedy_accept_lists); the tensor path decides the
    rest. Both give the same path and output, ties between equal sibling drafts and padding included."""
    from specdec_kernels.tree import _greedy_accept_lists, _greedy_accept_tensors

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 7, 12, 17):
        for _ in range(40):
            B = 3
            par = torch.full((B, n), -1, dtype=torch.long)
            for i in range(1, n):
                par[:, i] = torch.randint(0, i, (B,), generator=g)
            tok = torch.randint(0, 3, (B, n), generator=g)  # 3 ids: many equal siblings, many matches
            tok[torch.rand(B, n, generator=g) < 0.15] = -1  # padding never matches
            am = torch.randint(0, 3, (B, n), generator=g)
            fast = _greedy_accept_lists(par.tolist(), tok.tolist(), am.tolist())
            slow = _greedy_accept_tensors(par, tok, am)
            assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), (par, tok, am)
            assert all(torch.equal(a, b) for a, b in zip(tree_greedy_accept_ref(par, tok, am), slow))
    # a parent after its child: the walk declines and the tensor path answers
    assert _greedy_accept_lists([[-1, 2, 0]], [[0, 1, 1]], [[1, 1, 1]]) is None
