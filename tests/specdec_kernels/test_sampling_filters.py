"""specdec_kernels/sampling_filters.py: temperature, top-k, top-p, min-p on hand-written logits, and the fast
top-k/top-p path against the one-sort reference."""

import math

import pytest
import torch

from specdec_kernels.sampling_filters import (apply_min_p_ref, apply_temperature_ref, apply_top_k_top_p,
                                      apply_top_k_top_p_ref)

T = torch.tensor
LOGITS = torch.log(T([[0.4, 0.3, 0.2, 0.1]]))  # probs 0.4, 0.3, 0.2, 0.1


def kept(x: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != float("-inf")] for row in x.tolist()]


def test_temperature():
    x = T([[2.0, 4.0], [2.0, 4.0]])
    assert apply_temperature_ref(x, T([2.0, 0.0])).tolist() == [[1.0, 2.0], [2.0, 4.0]]  # 0 = greedy: unscaled


@pytest.mark.parametrize("fn", [apply_top_k_top_p_ref, apply_top_k_top_p])
def test_top_k(fn):
    x = T([[1.0, 5.0, 3.0, 3.0, 0.0]] * 4)
    # k=2: 5 and the tied 3s (cut-off on the value); k=1: only 5; k=0 and k>=V: off
    assert kept(fn(x, T([2, 1, 0, 9]), None)) == [[1, 2, 3], [1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("fn", [apply_top_k_top_p_ref, apply_top_k_top_p])
def test_top_p(fn):
    x = LOGITS.expand(5, 4)
    # cumulative mass 0.4, 0.7, 0.9, 1.0: p=0.35 -> 1 token; 0.5 -> 2; 0.85 -> 3; 1.0 -> all; 0.1 -> 1
    assert kept(fn(x, None, T([0.35, 0.5, 0.85, 1.0, 0.1]))) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0]]


@pytest.mark.parametrize("fn", [apply_top_k_top_p_ref, apply_top_k_top_p])
def test_top_k_then_top_p(fn):
    # top-k=2 renormalises 0.4, 0.3 to 0.571, 0.429; top-p 0.55 then needs only the first
    assert kept(fn(LOGITS, T([2]), T([0.55]))) == [[0]]
    # without top-k, 0.55 needs two tokens (0.4 < 0.55)
    assert kept(fn(LOGITS, T([0]), T([0.55]))) == [[0, 1]]


def test_min_p():
    x = LOGITS.expand(3, 4)
    # min_p * max p: 0.5 * 0.4 = 0.2 keeps 0.4, 0.3, 0.2; 0.8 * 0.4 = 0.32 keeps 0.4; 0 keeps all
    assert kept(apply_min_p_ref(x, T([0.5, 0.8, 0.0]))) == [[0, 1, 2], [0], [0, 1, 2, 3]]
    # kept logits are unchanged
    assert torch.equal(apply_min_p_ref(x, T([0.5, 0.8, 0.0]))[0, :3], x[0, :3])


@pytest.mark.parametrize("V,scale", [(3000, 4.0), (3000, 0.05), (6000, 0.05), (50, 1.0)])
def test_fast_top_k_top_p_matches_reference(V, scale):
    # peaked rows (nucleus inside the first 256 candidates) mixed with flat ones (4096 candidates, or the
    # full-sort fallback at V = 6000)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(8, V, generator=g) * scale
    x[:4, :10] += 8.0
    top_k = T([0, 5, 50, 2000, -1, 1, 0, 100])
    top_p = T([0.9, 1.0, 0.5, 0.95, 0.99, 0.3, 1.0, 0.8])
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        ref = apply_top_k_top_p_ref(x, k, p)
        fast = apply_top_k_top_p(x, k, p)
        assert torch.equal(ref, fast)
    assert not math.isinf(float(apply_top_k_top_p(x, top_k, top_p).max()))
