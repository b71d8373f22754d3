"""specdec_kernels/rejection.py: the acceptance rule u * q < p (one-hot and padded drafts included) and the
recovered token drawn from the residual max(p - q, 0), on hand-written cases."""

import torch

import specdec_kernels

OPS = specdec_kernels.get_ops("torch")
T = torch.tensor


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
