"""specdec/verify/tree.py: tree verification is lossless (multi-draft recursive rejection sampling) and exact
under greedy matching; TreeShape's checks, ends_at_leaf and chosen_logprobs on hand-written trees.

Statistical design (as tests/verify/test_chain.py). Target and draft are Markov chains over V = 8 tokens. A
tree of depth 2 hangs off the context token: c = 2 or 3 children drawn from Q[ctx] (with replacement:
i.i.d.; without: each from Q minus the earlier siblings, renormalised; or deterministically, the top-c
tokens of Q with one-hot q), and 2 children under each, drawn the same way from Q[child]. N = 100k trees
are verified in one vectorised call; the first two tokens of the generated sequence (the second from
plain sampling when the step emitted one) must follow P[ctx][x0] * P[x0][x1]: chi-square p > 1e-3 on the
64 cells and TV < 0.02 (joint) / 0.01 (first token), fixed seeds. The check has power: verifying the
same trees with a q that is not the law they were drawn from fails it with p < 1e-6.
"""

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of, tv_distance
from specdec_kernels.tree import tree_greedy_accept_ref
from specdec.sampling.sampler import make_generators
from specdec.datamodel.sampling_params import SamplingParams as SP
from specdec.interfaces import Verdict
from specdec.spec_decode.proposer import TreeProposals, TreeShape
from specdec.verify.tree import TreeVerifier, ends_at_leaf, tree_rejection_sample
from specdec.sampling.logprobs import chosen_logprobs

T = torch.tensor
V = 8
N = 100_000
CTX = 0


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chain(seed: int, sharpness: float = 1.0) -> torch.Tensor:
    """[V, V] random Markov transition matrix; row = previous token."""
    return torch.softmax(torch.randn(V, V, generator=gen(seed)) * sharpness, dim=-1)


def draw_children(q: torch.Tensor, m: int, mode: str, g: torch.Generator):
    """m children per row from q [n, V]: tokens [n, m], and the law each was drawn from [n, m, V]
    (None for deterministic top-m children)."""
    if mode == "topk":
        return q.topk(m, dim=-1).indices, None
    if mode == "with":
        return torch.multinomial(q, m, replacement=True, generator=g), q[:, None].expand(-1, m, -1)
    toks, laws = [], []
    left = q.clone()
    for _ in range(m):  # without replacement: each sibling from q minus the earlier ones
        law = left / left.sum(-1, keepdim=True)
        x = torch.multinomial(law, 1, generator=g)[:, 0]
        toks.append(x)
        laws.append(law)
        left = left.scatter(1, x[:, None], 0.0)
    return torch.stack(toks, 1), torch.stack(laws, 1)


def make_trees(P: torch.Tensor, Q: torch.Tensor, c: int, mode: str, seed: int, n: int = N):
    """Root-inclusive trees: node 0 = ctx, nodes 1..c its children, then 2 children per child."""
    g = gen(seed)
    kids, kid_q = draw_children(Q[torch.full((n,), CTX)], c, mode, g)  # [n, c]
    grand, grand_q = draw_children(Q[kids.reshape(-1)], 2, mode, g)  # [n*c, 2]
    tokens = torch.cat([torch.full((n, 1), CTX), kids, grand.reshape(n, 2 * c)], 1)  # [n, M]
    parents = T([-1] + [0] * c + [1 + i // 2 for i in range(2 * c)]).expand(n, -1)
    q = None
    if kid_q is not None:
        q = torch.cat([torch.zeros(n, 1, V), kid_q, grand_q.reshape(n, 2 * c, V)], 1)  # [n, M, V]
    return parents, tokens, P[tokens], q  # target at node j: P[token_j]


def sample(parents, tokens, target, q, seed: int):
    g = gen(seed)
    n, M = parents.shape
    u = torch.rand(n, M, generator=g)
    e = -torch.rand(n, V, generator=g).log()
    return tree_rejection_sample(parents, tokens, target, q, u, e)


def first_two(out: torch.Tensor, P: torch.Tensor, seed: int) -> torch.Tensor:
    """[n] joint cell x0 * V + x1 of the first two generated tokens (x1 by plain sampling if needed)."""
    x0 = out[:, 0]
    assert bool((x0 >= 0).all())  # a step always emits at least one token
    nxt = torch.multinomial(P[x0], 1, generator=gen(seed))[:, 0]
    return x0 * V + torch.where(out[:, 1] >= 0, out[:, 1], nxt)


def assert_lossless(out: torch.Tensor, P: torch.Tensor, seed: int) -> None:
    law = (P[CTX][:, None] * P).reshape(-1)
    cells = counts_of(first_two(out, P, seed), V * V)
    first = counts_of(out[:, 0], V)
    pv, tv, tv1 = chi_square_pvalue(cells, law), tv_distance(cells, law), tv_distance(first, P[CTX])
    assert pv > 1e-3 and tv < 0.02 and tv1 < 0.01, f"chi-square p={pv:.2g}, TV joint {tv:.4f}, first {tv1:.4f}"


@pytest.mark.parametrize("c, mode", [(2, "with"), (3, "with"), (2, "without"), (3, "without"), (3, "topk")])
def test_lossless_multi_draft(c, mode):
    P, Q = chain(1), chain(2)
    parents, tokens, target, q = make_trees(P, Q, c, mode, seed=10 + c)
    path, out = sample(parents, tokens, target, q, seed=20 + c)
    assert_lossless(out, P, seed=30 + c)
    # the emitted drafts are the tokens of a root-to-node path; then one final token, then -1
    n_acc = (path >= 0).sum(1) - 1
    assert bool((n_acc <= 2).all()) and bool((n_acc >= 1).any()) and bool((n_acc == 0).any())
    for d in (1, 2):
        rows = n_acc >= d
        node = path[rows, d]
        assert torch.equal(out[rows, d - 1], tokens[rows].gather(1, node[:, None])[:, 0])
        assert torch.equal(parents[rows].gather(1, node[:, None])[:, 0], path[rows, d - 1])
    assert bool((out[torch.arange(out.shape[1]) > n_acc[:, None]] == -1).all())


@pytest.mark.parametrize("mode", ["with", "without"])
def test_p_equals_q_accepts_the_first_child_always(mode):
    """min(1, p/q) = 1: the first child at every level is accepted, so every step emits depth + 1."""
    P = chain(3)
    parents, tokens, target, q = make_trees(P, P, 3, mode, seed=4)
    path, out = sample(parents, tokens, target, q, seed=5)
    assert path[:, :3].tolist() == [[0, 1, 4]] * N  # node 1, then node 1's first child (node 4)
    assert torch.equal(out[:, :2], tokens[:, [1, 4]]) and bool((out[:, 2] >= 0).all())
    # the bonus after the leaf follows P[leaf]
    cells = counts_of(tokens[:, 4] * V + out[:, 2], V * V)
    law = (counts_of(tokens[:, 4], V).double() / N)[:, None] * P.double()
    assert chi_square_pvalue(cells, law.reshape(-1)) > 1e-3


@pytest.mark.parametrize("mode", ["with", "without", "topk"])
def test_disjoint_supports_reject_every_child(mode):
    """Draft mass on tokens 0..3, target mass on 4..7: every child is rejected and the token is ~ p."""
    P = torch.zeros(V, V)
    P[:, 4:] = torch.softmax(torch.randn(V, 4, generator=gen(6)), -1)
    Q = torch.zeros(V, V)
    Q[:, :4] = torch.softmax(torch.randn(V, 4, generator=gen(7)), -1)
    parents, tokens, target, q = make_trees(P, Q, 3, mode, seed=8)
    path, out = sample(parents, tokens, target, q, seed=9)
    assert bool((path[:, 1:] == -1).all()) and bool((out[:, 1:] == -1).all())
    counts = counts_of(out[:, 0], V)
    assert chi_square_pvalue(counts, P[CTX]) > 1e-3 and tv_distance(counts, P[CTX]) < 0.01


@pytest.mark.parametrize("c, mode, wrong", [
    (3, "with", "uniform"),  # sampled children verified against a q they were not drawn from
    (3, "topk", "Q"),  # deterministic top-k children verified as if sampled from Q
])
def test_wrong_q_is_detected(c, mode, wrong):
    P, Q = chain(1), chain(2)
    parents, tokens, target, q = make_trees(P, Q, c, mode, seed=11)
    if wrong == "uniform":
        q = torch.full_like(q, 1.0 / V)
    else:
        q = torch.cat([torch.zeros(N, 1, V), Q[tokens[:, :1].expand(-1, c)],
                       Q[tokens[:, 1 : 1 + c]].repeat_interleave(2, 1)], 1)
    _, out = sample(parents, tokens, target, q, seed=12)
    law = (P[CTX][:, None] * P).reshape(-1)
    assert chi_square_pvalue(counts_of(first_two(out, P, 13), V * V), law) < 1e-6


# ------------------------------------------------------------------ vectorised vs a one-row reference


def reference_row(parents: list[int], tokens: list[int], target: torch.Tensor, q: torch.Tensor | None,
                  u: torch.Tensor, e: torch.Tensor) -> list[int]:
    """The rule as written in specdec/verify/tree.py's docstring, one tree at a time."""
    out, cur, p = [], 0, target[0]
    while True:
        accepted = None
        for j in [j for j in range(1, len(parents)) if parents[j] == cur and tokens[j] >= 0]:
            x = tokens[j]
            qj = torch.nn.functional.one_hot(T(x), V).float() if q is None else q[j]
            if u[j] * qj[x] < p[x]:  # accept with min(1, p(x) / q(x))
                accepted = j
                break
            r = (p - qj).clamp(min=0)
            p = r / r.sum() if r.sum() > 0 else p
        if accepted is None:
            return out + [int((p / e).argmax())]
        out.append(tokens[accepted])
        cur, p = accepted, target[accepted]


def random_forest(n: int, M: int, seed: int):
    """n random root-inclusive trees of M nodes (parent < index), some nodes padded with -1."""
    g = gen(seed)
    parents = torch.stack([torch.randint(0, max(i, 1), (n,), generator=g) for i in range(M)], 1)
    parents[:, 0] = -1
    tokens = torch.randint(0, V, (n, M), generator=g)
    real = torch.randint(1, M + 1, (n,), generator=g)
    tokens[torch.arange(M)[None] >= real[:, None]] = -1
    parents = torch.where(tokens >= 0, parents, torch.zeros_like(parents))
    parents[:, 0] = -1
    target = torch.softmax(torch.randn(n, M, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(n, M, V, generator=g) * 2, -1)
    return parents, tokens, target, q


@pytest.mark.parametrize("one_hot", [False, True])
def test_matches_one_row_reference(one_hot):
    n, M = 400, 7
    parents, tokens, target, q = random_forest(n, M, seed=14)
    q = None if one_hot else q
    u = torch.rand(n, M, generator=gen(15))
    e = -torch.rand(n, V, generator=gen(16)).log()
    _, out = tree_rejection_sample(parents, tokens, target, q, u, e)
    for b in range(n):
        ref = reference_row(parents[b].tolist(), tokens[b].tolist(), target[b], None if q is None else q[b], u[b], e[b])
        assert out[b, : len(ref)].tolist() == ref and bool((out[b, len(ref):] == -1).all()), f"row {b}"


# ------------------------------------------------------------------ TreeVerifier (the worker's entry)


def test_verifier_greedy_rows_match_the_greedy_kernel_and_random_rows_stay_lossless():
    """Mixed batch: greedy rows = exact longest path; random rows (temperature 0.8, top-k 6) follow the
    *processed* target, with the trees drawn from Q without replacement."""
    P_raw, Q = chain(3, sharpness=1.5), chain(4)
    logit_rows = torch.log(P_raw)
    kth = logit_rows.topk(6, dim=-1).values[:, -1:]
    P = torch.softmax((logit_rows / 0.8).masked_fill(logit_rows < kth, float("-inf")), -1)
    parents, tokens, _, q = make_trees(P, Q, 2, "without", seed=17)
    logits = torch.log(P_raw)[tokens]  # [N, M, V] raw target logits after each node
    g, r = SP(temperature=0.0), SP(temperature=0.8, top_k=6)
    params = [g if i % 10 == 0 else r for i in range(N)]
    torch.manual_seed(18)
    path, out = TreeVerifier().verify(logits, parents, tokens, q, params)
    greedy = torch.arange(N) % 10 == 0
    g_path, g_out = tree_greedy_accept_ref(parents[greedy], tokens[greedy], logits[greedy].argmax(-1))
    assert torch.equal(path[greedy], g_path) and torch.equal(out[greedy], g_out)
    assert_lossless(out[~greedy], P, seed=19)


def test_verifier_seeded_rows_are_reproducible_whatever_the_batch():
    """A seeded row's tokens depend on its tree and seed only: not on its neighbours, nor on how far the
    batch pads its trees (a fixed noise_width), over several steps of the same generators."""
    P, Q = chain(5), chain(6)
    parents, tokens, target, q = make_trees(P, Q, 2, "with", seed=20, n=6)  # M = 7
    M = parents.shape[1]
    wide = lambda x, fill: torch.cat([x, torch.full((x.shape[0], 3, *x.shape[2:]), fill, dtype=x.dtype)], 1)
    params = [SP(temperature=1.0, seed=s) for s in range(6)]
    g_all, g_two = make_generators(params), make_generators(params[2:4])
    for _ in range(3):
        # the whole batch, padded to M + 3 nodes (padding: token -1 under the root)
        _, a = TreeVerifier().verify(wide(target.log(), 0.0), wide(parents, 0), wide(tokens, -1), wide(q, 0.0),
                                     params, g_all, noise_width=M + 3)
        _, b = TreeVerifier().verify(target[2:4].log(), parents[2:4], tokens[2:4], q[2:4], params[2:4], g_two,
                                     noise_width=M + 3)
        assert torch.equal(a[2:4, :M], b) and bool((a[:, M:] == -1).all())


def test_greedy_hand_written_tree():
    # pending -> {0: tok 5, 1: tok 6}; 0 -> {2: tok 7}; target argmax: after pending 6, after node 1: 9
    props = TreeProposals(token_ids=T([[5, 6, 7]]), parents=T([[-1, -1, 0]]), num_nodes=T([3]))
    parents, tokens = props.with_root(T([1]))
    logits = torch.zeros(1, 4, 16)
    logits[0, 0, 6] = logits[0, 2, 9] = 5.0  # the second child matches, then 9 after it
    logits[0, 1, 7] = 5.0  # would accept node 2, but its parent (node 0) is rejected
    path, out = TreeVerifier().verify(logits, parents, tokens, None, [SP(temperature=0.0)])
    assert path.tolist() == [[0, 2, -1, -1]] and out.tolist() == [[6, 9, -1, -1]]



def test_verifier_shape_errors_name_the_expected_shapes():
    parents, tokens = T([[-1, 0]]), T([[1, 5]])
    with pytest.raises(ValueError, match=r"logits \(1, 3, 8\), parents \(1, 2\).*expected \[B, M, V\]"):
        TreeVerifier().verify(torch.zeros(1, 3, V), parents, tokens, None, [SP(temperature=0.0)])
    with pytest.raises(ValueError, match=r"noise_width=1 < 2 nodes per row"):
        TreeVerifier().verify(torch.zeros(1, 2, V), parents, tokens, None, [SP(temperature=1.0)], noise_width=1)


# ------------------------------------------------------------------ TreeShape, ends_at_leaf, chosen_logprobs


@pytest.mark.parametrize("depth, topk, budget", [(0, 2, 4), (3, 0, 4), (3, 2, 0)])
def test_tree_shape_refuses_a_size_below_1_naming_the_keys(depth, topk, budget):
    with pytest.raises(ValueError, match="tree_depth / tree_topk / tree_budget"):
        TreeShape(depth=depth, topk=topk, budget=budget)


def test_ends_at_leaf_hand_written():
    # pending -> {0, 1}; 0 -> {2}. Row 0 accepts node 0 (it has a child: no bonus); row 1 accepts 0 then 2
    # (a leaf: the emitted token is a bonus); row 2 accepts nothing; row 3 is a chain of 2 fully accepted
    # (a leaf), with a padding node whose parent is ignored.
    props = TreeProposals(token_ids=T([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, -1]]),
                          parents=T([[-1, -1, 0], [-1, -1, 0], [-1, -1, 0], [-1, 0, 1]]), num_nodes=T([3, 3, 3, 2]))
    verdict = Verdict(path=T([[0, 1, -1, -1], [0, 1, 3, -1], [0, -1, -1, -1], [0, 1, 2, -1]]),
                      out=T([[5, 9, -1, -1], [5, 7, 9, -1], [9, -1, -1, -1], [5, 6, 9, -1]]))
    assert ends_at_leaf(props, verdict).tolist() == [False, True, False, True]


def test_chosen_logprobs_are_the_raw_log_softmax_at_the_accepted_path():
    g = gen(30)
    logits = torch.randn(2, 4, V, generator=g)  # [B, M, V] root-inclusive
    verdict = Verdict(path=T([[0, 2, 3, -1], [0, -1, -1, -1]]), out=T([[4, 1, 6, -1], [3, -1, -1, -1]]))
    lp = torch.log_softmax(logits, -1)
    want = [[float(lp[0, 0, 4]), float(lp[0, 2, 1]), float(lp[0, 3, 6])], [float(lp[1, 0, 3])]]
    got = chosen_logprobs(logits, verdict)
    assert [len(r) for r in got] == [3, 1]
    for a, b in zip(got, want):
        torch.testing.assert_close(T(a), T(b))
