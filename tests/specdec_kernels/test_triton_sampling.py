"""Triton sampling-parameter ops (specdec_kernels/triton_ops/{sampling_filters,expand}.py) against the torch
references, and ``Sampler(kernel="triton")`` / ``logits_to_probs`` end to end.

Top-k / top-p keep exactly the reference's set here: the bisection finds the exact cut-off key, and the
rows are built so that no nucleus mass lies within rounding of top_p (see the module docstring)."""

import pytest
import torch

import specdec_kernels
from specdec_kernels.sampling_filters import apply_top_k_top_p_ref
from specdec_kernels.triton_ops import _common
from specdec.sampling.sampler import Sampler, logits_to_probs, make_generators
from specdec.datamodel.sampling_params import SamplingParams as SP

REF = specdec_kernels.get_ops("torch")
TRI = specdec_kernels.get_ops("triton")
T = torch.tensor
LOGITS = torch.log(T([[0.4, 0.3, 0.2, 0.1]]))


def kept(x: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != float("-inf")] for row in x.tolist()]


def test_hand_written_filters():
    # the cases of test_sampling_filters.py: value cut-offs keep ties; k <= 0 or >= V is off
    x = T([[1.0, 5.0, 3.0, 3.0, 0.0]] * 4)
    assert kept(TRI.apply_top_k_top_p(x, T([2, 1, 0, 9]), None)) == [[1, 2, 3], [1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    probs = LOGITS.expand(5, 4)
    assert kept(TRI.apply_top_k_top_p(probs, None, T([0.35, 0.5, 0.85, 1.0, 0.1]))) == [
        [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0]]
    assert kept(TRI.apply_top_k_top_p(LOGITS, T([2]), T([0.55]))) == [[0]]
    assert kept(TRI.apply_top_k_top_p(LOGITS, T([0]), T([0.55]))) == [[0, 1]]
    assert kept(TRI.apply_min_p(LOGITS.expand(3, 4), T([0.5, 0.8, 0.0]))) == [[0, 1, 2], [0], [0, 1, 2, 3]]
    assert TRI.apply_temperature(T([[2.0, 4.0], [2.0, 4.0]]), T([2.0, 0.0])).tolist() == [[1.0, 2.0], [2.0, 4.0]]
    # negative logits, -0.0 == +0.0, and -inf already masked
    y = T([[-0.0, 0.0, -1.0, float("-inf"), -3.0]])
    assert kept(TRI.apply_top_k_top_p(y, T([2]), None)) == [[0, 1]]


def random_rows(N: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 2
    x[: N // 2, :7] += 6.0  # peaked rows beside flat ones
    x[0, 1:3] = x[0, 2:3].clone() if V > 2 else x[0, 1:3]  # an exact tie
    return x


@pytest.mark.parametrize("N,V", [(1, 1), (5, 7), (9, 997)])
def test_filters_match_reference(N, V):
    x = random_rows(N, V, seed=V)
    g = torch.Generator().manual_seed(1)
    top_k = torch.randint(-1, V + 2, (N,), generator=g)
    top_p = torch.rand(N, generator=g) * 0.9 + 0.05
    top_p[0] = 1.0
    temperature = torch.rand(N, generator=g) + 0.1
    temperature[-1] = 0.0
    min_p = torch.rand(N, generator=g) * 0.3
    torch.testing.assert_close(TRI.apply_temperature(x, temperature), REF.apply_temperature(x, temperature))
    assert torch.equal(TRI.apply_min_p(x, min_p), REF.apply_min_p(x, min_p))
    # both filters (rows with top-k off test top-p alone; the hand-written cases test each filter alone)
    assert torch.equal(TRI.apply_top_k_top_p(x, top_k, top_p), apply_top_k_top_p_ref(x, top_k, top_p))


def test_filters_with_gpu_sized_tiles(monkeypatch):
    # small tiles: several programs per row block and several V chunks per row, as on a GPU
    monkeypatch.setattr(_common, "INTERPRETED_TILE", 512)
    x = random_rows(3, 70, seed=4)
    top_k, top_p = T([3, 0, 10]), T([0.9, 0.3, 0.6])
    assert torch.equal(TRI.apply_top_k_top_p(x, top_k, top_p), apply_top_k_top_p_ref(x, top_k, top_p))
    min_p, temperature = T([0.1, 0.0, 1.0]), T([0.5, 0.0, 2.0])
    assert torch.equal(TRI.apply_min_p(x, min_p), REF.apply_min_p(x, min_p))
    torch.testing.assert_close(TRI.apply_temperature(x, temperature), REF.apply_temperature(x, temperature))


def test_top_k_top_p_large_vocab():
    # V = 50,001 (13 chunks of 4096): one peaked and one flat row, both filters
    x = random_rows(2, 50_001, seed=2)
    top_k, top_p = T([40, 30_000]), T([0.7, 0.5])
    assert torch.equal(TRI.apply_top_k_top_p(x, top_k, top_p), apply_top_k_top_p_ref(x, top_k, top_p))


def test_expand_per_token_matches_reference():
    for x in (torch.arange(5.0), torch.arange(10).view(5, 2), torch.rand(5, 3, 2) < 0.5):
        for n in (0, 1, 3, T([1, 0, 3, 2, 5])):
            assert torch.equal(TRI.expand_per_token(x, n), REF.expand_per_token(x, n))
    with pytest.raises(ValueError, match="one count per row"):
        TRI.expand_per_token(torch.arange(3.0), T([1, 2]))
    with pytest.raises(ValueError, match=">= 0"):
        TRI.expand_per_token(torch.arange(3.0), -1)


def test_sampler_and_logits_to_probs_same_tokens():
    V = 301
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3)) * 3
    params = [SP(temperature=0.0), SP(temperature=0.7, seed=1, top_k=20), SP(temperature=1.0, top_p=0.8, seed=2),
              SP(temperature=1.3, min_p=0.05, seed=3), SP(temperature=0.9, top_k=7, top_p=0.9, seed=4),
              SP(temperature=1.0, seed=5)]
    outs = [Sampler(kernel=kn)(logits, params, make_generators(params)) for kn in ("torch", "triton")]
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    temperature = T([p.temperature for p in params])
    top_k, top_p = T([p.top_k for p in params]), T([p.top_p for p in params])
    torch.testing.assert_close(logits_to_probs(logits, temperature, top_k, top_p, kernel="triton"),
                               logits_to_probs(logits, temperature, top_k, top_p, kernel="torch"))
