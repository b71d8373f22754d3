"""The one speedup: a ratio of means with a bootstrap interval over prompts (specdec/experiment/speedup.py)."""

import random

import pytest

from specdec.experiment.speedup import bootstrap_interval, mean_of_ratios, ratio_of_means


def test_ratio_of_means_weighs_prompts_by_their_time():
    spec = [(100, 1.0), (10, 0.01)]  # a long prompt at 100/s and a tiny one at 1000/s
    base = [(100, 2.0), (10, 0.1)]  # plain: 50/s and 100/s
    assert ratio_of_means(spec, base) == pytest.approx((110 / 1.01) / (110 / 2.1))
    assert mean_of_ratios(spec, base) == pytest.approx((2.0 + 10.0) / 2)  # the tiny prompt doubles it
    assert ratio_of_means([], []) is None and ratio_of_means([(1, 0.0)], [(1, 1.0)]) is None


def test_interval_holds_the_figure_and_shrinks_with_more_prompts():
    rng = random.Random(1)

    def sample(n):
        spec, base = [], []
        for _ in range(n):
            toks, t = 128, rng.uniform(2.0, 10.0)
            base.append((toks, t))
            spec.append((toks, t / rng.uniform(1.2, 1.8)))  # true speedups between 1.2x and 1.8x
        return spec, base

    widths = []
    for n in (8, 128):
        spec, base = sample(n)
        lo, hi = bootstrap_interval(spec, base)
        assert lo <= ratio_of_means(spec, base) <= hi and 1.1 < lo and hi < 1.9
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # ~1/sqrt(n)
    assert bootstrap_interval(*sample(8)) != bootstrap_interval(*sample(8))  # the data moves it, not only the seed


def test_interval_needs_two_prompts_and_matched_pairs():
    assert bootstrap_interval([(10, 1.0)], [(10, 2.0)]) is None
    with pytest.raises(ValueError, match="2 speculative prompts but 1 plain"):
        bootstrap_interval([(10, 1.0), (10, 1.0)], [(10, 2.0)])
    lo, hi = bootstrap_interval([(10, 1.0)] * 5, [(10, 2.0)] * 5)  # no spread: a point
    assert lo == hi == pytest.approx(2.0)
