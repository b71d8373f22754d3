"""specdec_kernels/greedy_verify.py: exact greedy matching on hand-written cases (k = 0 and 1 included) and its
shape check."""

import pytest
import torch

import specdec_kernels

OPS = specdec_kernels.get_ops("torch")
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
