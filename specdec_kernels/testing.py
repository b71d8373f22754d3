"""Statistics for testing samplers against a target distribution: chi-square p-value and TV distance.

Used by the losslessness tests (and any end-to-end distribution check). Uses scipy when importable, else
its own regularized incomplete gamma (Numerical Recipes 6.2), so the tests need only torch.
"""

from __future__ import annotations

import math

import torch

# Cochran's rule: chi-square needs expected counts >= 5; rarer categories are pooled into one bin.
_MIN_EXPECTED = 5.0


def counts_of(token_ids: torch.Tensor, num_categories: int) -> torch.Tensor:
    """[N] int64 ids in [0, num_categories) -> [num_categories] int64 counts; raises on out-of-range ids."""
    ids = token_ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_categories):
        raise ValueError(f"counts_of: ids outside [0, {num_categories}): min {int(ids.min())}, "
                         f"max {int(ids.max())}.")
    return torch.bincount(ids, minlength=num_categories)


def tv_distance(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Total-variation distance between the empirical distribution of ``counts`` and ``probs``."""
    counts = counts.to(torch.float64)
    return 0.5 * float((counts / counts.sum() - probs.to(torch.float64)).abs().sum())


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) = Gamma(a, x) / Gamma(a)."""
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    # continued fraction for Q(a, x) (modified Lentz)
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return _gamma_q(dof / 2.0, statistic / 2.0)
    return float(chi2.sf(statistic, dof))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness-of-fit p-value of ``counts`` [C] against ``probs`` [C] (rare cells pooled).

    A category with probability 0 that was observed gives p-value 0 (impossible outcome).
    """
    counts = counts.to(torch.float64).reshape(-1)
    probs = probs.to(torch.float64).reshape(-1)
    if counts.shape != probs.shape:
        raise ValueError(f"chi_square_pvalue: {counts.numel()} counts for {probs.numel()} probabilities.")
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    n = counts.sum()
    expected = probs / probs.sum() * n
    big = expected >= _MIN_EXPECTED
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(statistic, obs.numel() - 1)
