"""graft_chains (proposers/ngram_branch.py): an n-gram draft grafted onto a deterministic token tree.

- a chain whose first tokens follow an existing path reuses those nodes and adds only the rest;
- a chain that leaves at the root becomes a new root child; an empty chain leaves the row unchanged;
- rows of different sizes pad with token -1; parents stay topological (the SpeculativeProposals check);
- sampled trees (draft_probs) and a row-count mismatch are refused, naming the way out.
"""

import pytest
import torch

from proposers.ngram_branch import graft_chains
from specdec.spec_decode.proposer import TreeProposals


def tree(rows: list[tuple[list[int], list[int]]]) -> TreeProposals:
    N = max(len(t) for t, _ in rows)
    tok = torch.full((len(rows), N), -1, dtype=torch.long)
    par = torch.full((len(rows), N), -1, dtype=torch.long)
    for b, (t, p) in enumerate(rows):
        tok[b, : len(t)] = torch.tensor(t)
        par[b, : len(p)] = torch.tensor(p)
    return TreeProposals(tok, par, torch.tensor([len(t) for t, _ in rows]))


def paths(t: TreeProposals, b: int) -> set[tuple[int, ...]]:
    """Every root-to-node token path of row b."""
    out = set()
    for i in range(int(t.num_nodes[b])):
        path, j = [], i
        while j >= 0:
            path.append(int(t.token_ids[b, j]))
            j = int(t.parents[b, j])
        out.add(tuple(reversed(path)))
    return out


def test_a_chain_follows_the_path_it_shares_and_adds_the_rest():
    # root children 10, 20; 10 -> 11 -> 12; 20 -> 21
    t = tree([([10, 20, 11, 21, 12], [-1, -1, 0, 1, 2])])
    g = graft_chains(t, [[10, 11, 30]])
    assert int(g.num_nodes[0]) == 6  # 10 and 11 reused, 30 new under 11
    assert g.token_ids[0, :5].tolist() == [10, 20, 11, 21, 12] and g.parents[0, :5].tolist() == [-1, -1, 0, 1, 2]
    assert (int(g.token_ids[0, 5]), int(g.parents[0, 5])) == (30, 2)
    assert paths(g, 0) == paths(t, 0) | {(10, 11, 30)}


def test_a_chain_that_leaves_at_the_root_and_an_empty_chain():
    t = tree([([10, 20], [-1, -1]), ([7], [-1])])
    g = graft_chains(t, [[5, 6], []])
    assert g.num_nodes.tolist() == [4, 1]
    assert paths(g, 0) == {(10,), (20,), (5,), (5, 6)}
    assert paths(g, 1) == {(7,)}
    assert g.token_ids[1, 1:].tolist() == [-1, -1, -1]  # padding


def test_a_chain_inside_the_tree_adds_nothing():
    t = tree([([10, 11], [-1, 0])])
    g = graft_chains(t, [[10, 11]])
    assert g.num_nodes.tolist() == [2] and torch.equal(g.token_ids, t.token_ids)


def test_padding_rows_keep_their_padding_out_of_the_match():
    """Padding past num_nodes (token -1) is not a node a chain could follow."""
    t = tree([([10, 11, 12], [-1, 0, 1]), ([10], [-1])])
    g = graft_chains(t, [[10, 11], [10, 11]])
    assert g.num_nodes.tolist() == [3, 2]
    assert paths(g, 1) == {(10,), (10, 11)}


def test_sampled_trees_and_row_mismatch_are_refused():
    t = tree([([10], [-1])])
    with pytest.raises(ValueError, match="2 chains for a tree of 1 rows"):
        graft_chains(t, [[1], [2]])
    t.draft_probs = torch.full((1, 1, 32), 1 / 32)
    with pytest.raises(ValueError, match="deterministic"):
        graft_chains(t, [[1]])


def test_within_budget_the_head_gives_up_only_the_room_the_chain_takes():
    """graft_within_budget: the head's worst-ranked nodes go, as few as the chain needs; no chain, or a chain
    along the head's own path, costs no room; a chain of new tokens costs its length."""
    from proposers.ngram_branch import graft_within_budget

    # root children 10 (rank 0), 20 (rank 1); 10 -> 11 (rank 2); 20 -> 21 (rank 3); 11 -> 12 (rank 4)
    t = tree([([10, 20, 11, 21, 12], [-1, -1, 0, 1, 2])])
    rank = torch.tensor([[0, 1, 2, 3, 4]])
    assert torch.equal(graft_within_budget(t, rank, [[]], 5).token_ids, t.token_ids)  # no chain: all kept
    g = graft_within_budget(t, rank, [[10, 11, 12]], 5)  # along the head's path: nothing dropped
    assert g.num_nodes.tolist() == [5] and paths(g, 0) == paths(t, 0)
    g = graft_within_budget(t, rank, [[10, 11, 30]], 5)  # one new node: the worst-ranked (12) goes
    assert g.num_nodes.tolist() == [5] and paths(g, 0) == {(10,), (20,), (10, 11), (20, 21), (10, 11, 30)}
    g = graft_within_budget(t, rank, [[5, 6]], 5)  # two new nodes: 12 and 21 go
    assert paths(g, 0) == {(10,), (20,), (10, 11), (5,), (5, 6)}
    # the ranks decide, not the node order: rank 21 last, so it goes before 12
    g = graft_within_budget(t, torch.tensor([[0, 1, 2, 4, 3]]), [[5]], 5)
    assert paths(g, 0) == {(10,), (20,), (10, 11), (10, 11, 12), (5,)}
    for b in (2, 3, 4, 5, 6):  # never past the budget, and the chain is always whole
        g = graft_within_budget(t, rank, [[5, 6]], b)
        assert int(g.num_nodes[0]) <= b and (5, 6) in paths(g, 0)


def test_within_budget_equals_a_fixed_split_or_more():
    """The filled tree holds the fixed split's (budget - m head nodes + chain), so a greedy step accepts at
    least as much; rows of a batch are filled independently."""
    from proposers.ngram_branch import graft_within_budget

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, m, budget = 6, 2, 6
        par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tok = torch.randint(0, 4, (n,), generator=g).tolist()
        rows = [(tok, par), (tok[:4], par[:4])]
        t = tree(rows)
        rank = torch.tensor([list(range(n)), list(range(4)) + [-1, -1]])  # node order is a valid rank here
        chains = [torch.randint(0, 4, (int(torch.randint(0, m + 1, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(2)]
        filled = graft_within_budget(t, rank, chains, budget)
        for b in range(2):
            k = min(len(rows[b][0]), budget - len(chains[b]))
            fixed = graft_chains(tree([(rows[b][0][:k], rows[b][1][:k])]), [chains[b]])
            assert paths(fixed, 0) <= paths(filled, b)
            assert int(filled.num_nodes[b]) <= budget


def test_within_budget_refuses_ranks_that_are_not_prefix_closed():
    from proposers.ngram_branch import graft_within_budget

    t = tree([([10, 11], [-1, 0])])
    with pytest.raises(ValueError, match="parent of rank"):
        graft_within_budget(t, torch.tensor([[1, 0]]), [[5]], 2)


def test_a_leading_chain_goes_first_and_the_tree_stays_the_same():
    """lead_with_chain: the grafted path's nodes first (a policy's cut to n nodes keeps its first n), the others in
    their order after; parents stay topological and the set of root-to-node paths is unchanged."""
    from proposers.ngram_branch import graft_rows_within_budget, lead_rows, lead_with_chain

    t, p = [10, 20, 11, 21, 12], [-1, -1, 0, 1, 2]
    (gt, gp), = graft_rows_within_budget([t], [p], [5], [[0, 1, 2, 3, 4]], [[20, 21, 7, 8]], 8)
    lt, lp = lead_with_chain(gt, gp, [20, 21, 7, 8])
    assert lt[:4] == [20, 21, 7, 8] and lp[:4] == [-1, 0, 1, 2]  # the path, then 10 -> 11 -> 12
    assert all(q < i for i, q in enumerate(lp))
    assert paths(tree([(lt, lp)]), 0) == paths(tree([(gt, gp)]), 0)
    assert lead_rows([(gt, gp), (gt, gp)], [[20, 21, 7, 8], []], [True, False]) == [(lt, lp), (gt, gp)]


def test_the_ngram_branch_drafts_long_and_leads_only_after_a_long_match():
    """NGramBranch: a match of LONG_FROM tokens or more drafts the whole m and leads; a shorter one at most SHORT."""
    from types import SimpleNamespace

    from proposers.ngram_branch import NGramBranch

    br = NGramBranch(SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4))
    long = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # "1 2 3" seen before: a 3-gram match, then 4 5 6 7 8 9 1 ...
    short = [1, 50, 51, 52, 53, 54, 55, 56, 60, 1]  # only "1" matches
    batch = SimpleNamespace(seq_ids=[0, 1], sequences=None, token_ids=[long, short])
    chains, lead = br.chains(batch, 6)
    assert chains[0] == [4, 5, 6, 7, 8, 9] and lead[0]
    assert chains[1] == [50, 51, 52][: NGramBranch.SHORT] and not lead[1]
