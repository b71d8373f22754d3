"""specdec_kernels/typical.py: Medusa's typical acceptance threshold min(epsilon, delta * exp(-H)) on hand-written
distributions, padding never accepted."""

import math

import torch

import specdec_kernels

OPS = specdec_kernels.get_ops("torch")
T = torch.tensor


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
