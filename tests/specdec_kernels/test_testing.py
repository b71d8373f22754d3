"""specdec_kernels/testing.py: the chi-square p-value (own incomplete gamma) and TV distance used by the
losslessness tests."""

import pytest
import torch

from specdec_kernels.testing import _gamma_q, chi_square_pvalue, counts_of, tv_distance


@pytest.mark.parametrize("stat,dof,expected", [
    # reference values of the chi-square survival function (scipy.stats.chi2.sf)
    (3.0, 1, 0.08326451666355042),
    (10.0, 5, 0.07523524614651217),
    (100.0, 63, 0.002077236552784822),
    (0.5, 3, 0.9188914116546758),
])
def test_own_chi2_sf(stat, dof, expected):
    assert _gamma_q(dof / 2, stat / 2) == pytest.approx(expected, rel=1e-9)


def test_chi_square_detects_and_accepts():
    probs = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    good = counts_of(torch.multinomial(probs, 50_000, replacement=True, generator=g), 3)
    bad = counts_of(torch.multinomial(torch.tensor([0.48, 0.32, 0.2]), 50_000, replacement=True,
                                      generator=g), 3)
    assert chi_square_pvalue(good, probs) > 1e-3
    assert chi_square_pvalue(bad, probs) < 1e-6
    assert tv_distance(torch.tensor([50, 30, 20]), probs) == pytest.approx(0.0, abs=1e-7)
    assert tv_distance(torch.tensor([100, 0, 0]), probs) == pytest.approx(0.5)
    # an observed impossible outcome is a certain failure
    assert chi_square_pvalue(torch.tensor([10, 0, 1]), torch.tensor([0.5, 0.5, 0.0])) == 0.0
    with pytest.raises(ValueError, match="outside"):
        counts_of(torch.tensor([0, 3]), 3)
