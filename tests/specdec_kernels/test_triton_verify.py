"""Triton verification ops (specdec_kernels/triton_ops/{greedy_verify,output,rejection,typical}.py) against their
torch references: token ids and masks exactly, on odd sizes (B, k, V not powers of two; k = 0 and 1;
V = 50,001 once), one-hot (None) and padded (-1) drafts, and strided inputs."""

import pytest
import torch

import specdec_kernels
from specdec_kernels.triton_ops import _common
from specdec_kernels.noise import draw_exponential, draw_uniform
from specdec.verify.chain import RejectionSampler

REF = specdec_kernels.get_ops("torch")
TRI = specdec_kernels.get_ops("triton")

# (B, k, V): odd sizes, k = 0 and 1, a batch wider than one program's tile at V = 5, and one V = 50,001
# (seven SPLIT_V programs per row, each several BLOCK_V chunks)
SHAPES = [(1, 0, 5), (3, 1, 7), (7, 3, 33), (5, 5, 1000), (3000, 2, 5), (2, 2, 50_001)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def peaked(shape, g) -> torch.Tensor:
    """Random distributions with a few dominant tokens (so drafts are often accepted)."""
    p = torch.rand(*shape, generator=g) ** 6
    return p / p.sum(-1, keepdim=True)


def case(B: int, k: int, V: int, seed: int = 0):
    g = gen(seed)
    target = peaked((B, k + 1, V), g)
    draft = peaked((B, k, V), g)
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, k) if k else torch.empty(B, 0).long()
    ids = torch.where(torch.rand(B, k, generator=g) < 0.1, -1, ids)  # some padding
    return target, draft, ids, g


@pytest.mark.parametrize("B,k,V", SHAPES)
def test_rejection_ops_match_reference(B, k, V):
    target, draft, ids, g = case(B, k, V)
    uniform = draw_uniform(B, k, generator=g)
    noise = draw_exponential(B, V, generator=g)
    for q in (draft, None):  # probabilistic drafts, one-hot drafts (n-gram)
        acc = TRI.rejection_accept(target, q, ids, uniform)
        assert torch.equal(acc, REF.rejection_accept(target, q, ids, uniform))
        n = TRI.num_accepted(acc)
        assert torch.equal(n, REF.num_accepted(acc))
        rec = TRI.sample_recovered(target, q, ids, n, noise)
        assert torch.equal(rec, REF.sample_recovered(target, q, ids, n, noise))
        bonus = torch.arange(B)
        assert torch.equal(TRI.create_output(acc, ids, rec, bonus), REF.create_output(acc, ids, rec, bonus))
    if V <= 1000:  # every position, not just the first rejection; the bonus position k included
        for pos in range(k + 1):
            at = torch.full((B,), pos)
            assert torch.equal(TRI.sample_recovered(target, draft, ids, at, noise),
                               REF.sample_recovered(target, draft, ids, at, noise))


def test_row_ops_with_gpu_sized_tiles(monkeypatch):
    # small tiles: many row blocks, several V chunks per SPLIT_V program and several splits per row
    monkeypatch.setattr(_common, "INTERPRETED_TILE", 64)  # BLOCK_V = 64: 2 chunks per split
    monkeypatch.setattr(_common, "SPLIT_V", 128)
    import specdec_kernels.triton_ops.rejection as rejection
    monkeypatch.setattr(rejection, "SPLIT_V", 128)
    B, k, V = 3, 2, 301  # 3 splits per row
    target, draft, ids, g = case(B, k, V, seed=9)
    uniform, noise = draw_uniform(B, k, generator=g), draw_exponential(B, V, generator=g)
    for q in (draft, None):
        assert torch.equal(TRI.rejection_accept(target, q, ids, uniform), REF.rejection_accept(target, q, ids, uniform))
        pos = torch.randint(0, k + 1, (B,), generator=g)
        assert torch.equal(TRI.sample_recovered(target, q, ids, pos, noise),
                           REF.sample_recovered(target, q, ids, pos, noise))
    assert torch.equal(TRI.typical_accept(target, ids, 0.09, 0.3), REF.typical_accept(target, ids, 0.09, 0.3))


def test_sample_recovered_hand_written_and_ties():
    # the cases of tests/specdec_kernels/test_rejection.py: residual argmax, one-hot removal, padding, bonus, p == q fallback
    T = torch.tensor
    ones = torch.ones(1, 4)
    p = T([[[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]]])
    q = T([[[0.0, 0.6, 0.0, 0.4]]])
    assert TRI.sample_recovered(p, q, T([[1]]), T([0]), ones).tolist() == [2]
    assert TRI.sample_recovered(p, None, T([[1]]), T([0]), ones).tolist() == [2]
    assert TRI.sample_recovered(p, q, T([[-1]]), T([0]), ones).tolist() == [1]
    assert TRI.sample_recovered(p, q, T([[1]]), T([1]), T([[1.0, 1.0, 0.5, 1.0]])).tolist() == [2]
    assert TRI.sample_recovered(p[:, :1], p[:, :1], T([[1]]), T([0]), ones).tolist() == [1]
    # exact ties go to the lowest token id, also across SPLIT_V programs (V = 20,000: 3 of them)
    flat = torch.full((2, 1, 20_000), 1 / 20_000)
    noise = torch.ones(2, 20_000)
    noise[1, 9000] = noise[1, 17_000] = 0.5  # two equal winners in different splits
    out = TRI.sample_recovered(flat, None, torch.empty(2, 0).long(), T([0, 0]), noise)
    assert out.tolist() == [0, 9000] == REF.sample_recovered(flat, None, torch.empty(2, 0).long(), T([0, 0]),
                                                             noise).tolist()


@pytest.mark.parametrize("B,k", [(1, 0), (2, 1), (9, 4), (5000, 3)])
def test_greedy_verify_matches_reference(B, k):
    g = gen(B + k)
    argmax = torch.randint(0, 3, (B, k + 1), generator=g)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.1, -1, torch.randint(0, 3, (B, k), generator=g))
    assert torch.equal(TRI.greedy_verify(argmax, drafts), REF.greedy_verify(argmax, drafts))
    # strided (column-major) inputs
    assert torch.equal(TRI.greedy_verify(argmax.t().contiguous().t(), drafts), REF.greedy_verify(argmax, drafts))


def test_greedy_verify_hand_written():
    T = torch.tensor
    target = T([[5, 6, 7, 8]] * 5)
    drafts = T([[5, 6, 7], [4, 6, 7], [5, 0, 7], [5, -1, -1], [9, 6, 7]])
    assert TRI.greedy_verify(target, drafts).tolist() == [[5, 6, 7, 8], [5, -1, -1, -1], [5, 6, -1, -1],
                                                          [5, 6, -1, -1], [5, -1, -1, -1]]


@pytest.mark.parametrize("B,k,V", [(1, 0, 5), (3, 1, 7), (6, 3, 1001)])
def test_typical_accept_matches_reference(B, k, V):
    target, _, ids, _ = case(B, k, V, seed=3)
    for thr, alpha in ((0.09, 0.3), (0.3, 0.5), (0.01, 0.05)):
        assert torch.equal(TRI.typical_accept(target, ids, thr, alpha), REF.typical_accept(target, ids, thr, alpha))


def test_same_seed_same_tokens_under_both_backends():
    B, k, V = 6, 3, 37
    target, draft, ids, _ = case(B, k, V, seed=5)
    bonus = torch.randint(0, V, (B, 1), generator=gen(1))

    def run(kernel: str, draft_probs):
        seeded = {i: gen(100 + i) for i in range(0, B, 2)}  # even rows seeded, odd rows from the global RNG
        torch.manual_seed(7)
        return RejectionSampler(kernel=kernel)(target, bonus, draft_probs, ids, seeded)

    for q in (draft, None):
        a, b = run("torch", q), run("triton", q)
        assert torch.equal(a, b)
        assert torch.equal(run("triton", q)[::2], a[::2])  # and seeded rows are reproducible


def test_launchers_check_shapes_dtypes_devices():
    p = torch.rand(2, 3, 5)
    with pytest.raises(ValueError, match=r"draft_token_ids has shape \(2, 3\), expected \[2, \?\]|at least"):
        TRI.rejection_accept(p, None, torch.zeros(2, 4, dtype=torch.int64), torch.rand(2, 4))
    with pytest.raises(ValueError, match="draft_probs has shape"):
        TRI.sample_recovered(p, torch.rand(2, 2, 4), torch.zeros(2, 2).long(), torch.zeros(2).long(), torch.ones(2, 5))
    with pytest.raises(ValueError, match="dtype"):
        TRI.greedy_verify(torch.zeros(2, 3), torch.zeros(2, 2).long())
    with pytest.raises(ValueError, match=r"expected \[2, 2\]"):
        TRI.greedy_verify(torch.zeros(2, 3).long(), torch.zeros(2, 1).long())
    with pytest.raises(ValueError, match="several devices"):
        TRI.rejection_accept(p, None, torch.zeros(2, 2).long(), torch.rand(2, 2, device="meta"))
