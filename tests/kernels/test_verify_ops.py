"""Hand-written cases for the verification ops: greedy_verify, create_output, rejection_accept,
sample_recovered, typical_accept (kernels/greedy_verify.py, output.py, rejection.py, typical.py)."""

import math

import pytest
import torch

import kernels

OPS = kernels.get_ops("torch")
T = torch.tensor


def test_greedy_verify_cases():
    target_argmax = T([[5, 6, 7, 8],  # all 3 drafts match -> 3 accepted + bonus 8
                       [5, 6, 7, 8],  # first draft wrong -> emit target 5, rest -1
                       [5, 6, 7, 8],  # 2nd draft wrong -> 5, then target's 6
                       [5, 6, 7, 8],  # padded proposal (len 1): 5 accepted, pad rejected -> target 6
                       [5, 6, 7, 8]])  # a later match after a mismatch does not count
    drafts = T([[5, 6, 7],
                [4, 6, 7],
                [5, 0, 7],
                [5, -1, -1],
                [9, 6, 7]])
    expected = T([[5, 6, 7, 8],
                  [5, -1, -1, -1],
                  [5, 6, -1, -1],
                  [5, 6, -1, -1],
                  [5, -1, -1, -1]])
    assert torch.equal(OPS.greedy_verify(target_argmax, drafts), expected)


def test_greedy_verify_k0_and_k1():
    # k = 0: the target's own token is the only output
    assert torch.equal(OPS.greedy_verify(T([[3], [4]]), torch.empty(2, 0, dtype=torch.int64)), T([[3], [4]]))
    # k = 1: accepted -> draft + bonus; rejected -> target token then -1
    assert torch.equal(OPS.greedy_verify(T([[3, 9], [3, 9]]), T([[3], [2]])), T([[3, 9], [3, -1]]))


def test_greedy_verify_shape_error():
    with pytest.raises(ValueError, match="expected \\[1, 2\\]"):
        OPS.greedy_verify(T([[1, 2, 3]]), T([[1]]))


def test_create_output_places_recovered_and_bonus():
    accepted = T([[True, True, True],  # all accepted -> bonus at position k
                  [True, False, True],  # first rejection at 1 -> recovered at 1; later True ignored
                  [False, True, True]])  # rejected at 0 -> recovered only
    drafts = T([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    recovered = T([70, 71, 72])
    bonus = T([90, 91, 92])
    out = OPS.create_output(accepted, drafts, recovered, bonus)
    assert torch.equal(out, T([[1, 2, 3, 90], [1, 71, -1, -1], [72, -1, -1, -1]]))
    assert torch.equal(OPS.num_accepted(accepted), T([3, 1, 0]))


def test_rejection_accept_rule():
    # V = 3; at each position p(x) and q(x) of the drafted token x = 0; uniform u decides u * q < p
    p = T([[[0.5, 0.25, 0.25], [0.2, 0.4, 0.4], [0.0, 0.5, 0.5]]])  # [1, 3, 3]
    q = T([[[0.25, 0.5, 0.25], [0.4, 0.3, 0.3], [0.5, 0.25, 0.25]]])
    drafts = T([[0, 0, 0]])
    # pos 0: q < p -> always accepted even at u ~ 1; pos 1: ratio 0.5, u=0.49 accepts; pos 2: p = 0 rejects
    assert OPS.rejection_accept(p, q, drafts, T([[0.999, 0.49, 0.0]])).tolist() == [[True, True, False]]
    # pos 1 with u = 0.51 > p/q = 0.5 -> rejected
    assert OPS.rejection_accept(p, q, drafts, T([[0.0, 0.51, 0.0]])).tolist() == [[True, False, False]]
    # one-hot drafts (None): accept iff u < p(x)
    assert OPS.rejection_accept(p, None, drafts, T([[0.49, 0.21, 0.0]])).tolist() == [[True, False, False]]
    # padding (-1) is never accepted, whatever u
    assert OPS.rejection_accept(p, q, T([[0, -1, -1]]), T([[0.0, 0.0, 0.0]])).tolist() == [[True, False, False]]


def test_sample_recovered_uses_residual():
    # noise of ones makes the exponential race an argmax of the weights
    ones = torch.ones(1, 4)
    p = T([[[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]]])  # [1, 2, 4]: position 0, bonus position 1
    q = T([[[0.0, 0.6, 0.0, 0.4]]])  # max(p - q, 0) = [0.1, 0, 0.3, 0] -> argmax 2 (p's argmax is 1)
    assert OPS.sample_recovered(p, q, T([[1]]), T([0]), ones).tolist() == [2]
    # one-hot q at x = 1 removes token 1 from p: argmax of [0.1, 0, 0.3, 0.2] is 2
    assert OPS.sample_recovered(p, None, T([[1]]), T([0]), ones).tolist() == [2]
    # padded draft: q counts as 0, plain p: argmax 1
    assert OPS.sample_recovered(p, q, T([[-1]]), T([0]), ones).tolist() == [1]
    # position k = 1 is the bonus position: plain p_k; noise picks among the tied 0.25s
    assert OPS.sample_recovered(p, q, T([[1]]), T([1]), T([[1.0, 1.0, 0.5, 1.0]])).tolist() == [2]
    # p == q (a rejection of probability 0, e.g. from rounding) falls back to p instead of token 0
    assert OPS.sample_recovered(p[:, :1], p[:, :1], T([[1]]), T([0]), ones).tolist() == [1]


def test_typical_accept_threshold():
    p0 = [0.7, 0.1, 0.1, 0.1]  # H = 0.9404 -> 0.3 * exp(-H) = 0.117 -> threshold min(0.09, .117) = 0.09
    p1 = [0.25, 0.25, 0.25, 0.25]  # H = ln 4 -> 0.3 / 4 = 0.075 -> threshold 0.075
    p2 = [0.97, 0.01, 0.01, 0.01]  # H = 0.1715 -> 0.3 * 0.842 = 0.253 -> threshold 0.09
    probs = T([[p0, p1, p2]])
    h = -sum(v * math.log(v + 1e-5) for v in p0)
    assert abs(min(0.09, 0.3 * math.exp(-h)) - 0.09) < 1e-12  # the comment above holds
    # 0.1 > 0.09 accepted; 0.25 > 0.075 accepted; 0.01 < 0.09 rejected
    assert OPS.typical_accept(probs, T([[1, 3, 2]]), 0.09, 0.3).tolist() == [[True, True, False]]
    # a stricter threshold 0.2 rejects 0.1 at position 0 (min(0.2, 0.117) = 0.117 > 0.1)
    assert OPS.typical_accept(probs, T([[1, 3, 0]]), 0.2, 0.3).tolist() == [[False, True, True]]
    # padding is never accepted
    assert OPS.typical_accept(probs, T([[0, -1, 0]]), 0.09, 0.3).tolist() == [[True, False, True]]


def test_expand_per_token():
    x = T([1.0, 2.0, 3.0])
    assert OPS.expand_per_token(x, 2).tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert OPS.expand_per_token(x, T([1, 0, 3])).tolist() == [1.0, 3.0, 3.0, 3.0]
    assert OPS.expand_per_token(x, 0).numel() == 0
    with pytest.raises(ValueError, match="one count per row"):
        OPS.expand_per_token(x, T([1, 2]))
