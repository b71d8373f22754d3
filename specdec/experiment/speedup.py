"""The one speedup: speculative tokens/s over plain tokens/s, each as total tokens over total seconds (a ratio
of means), with a bootstrap 95% interval over prompts.

Why not the mean of per-prompt ratios (Spec-Bench's tables): one noisy or very short prompt (a 4.7x ratio on a
question whose plain decode was interrupted) moves the mean by its own weight, whatever its length, while
the ratio of totals weighs every prompt by the time it costs, which is what a user of the framework pays.
The per-prompt mean stays available as ``speedup_mean_of_ratios``.

The interval resamples prompts with replacement (the percentile bootstrap, a fixed seed so a summary is
reproducible): it says how much the figure depends on which prompts were drawn and on each prompt's timing
noise, which plain and speculative decoding share because they are interleaved prompt by prompt.

Pure functions over (tokens, seconds) pairs; no torch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

Pair = tuple[float, float]  # (tokens, seconds) of one prompt


def ratio_of_means(spec: Sequence[Pair], base: Sequence[Pair]) -> float | None:
    """(sum spec tokens / sum spec seconds) / (sum base tokens / sum base seconds); None if either is empty."""
    st, ss = sum(t for t, _ in spec), sum(s for _, s in spec)
    bt, bs = sum(t for t, _ in base), sum(s for _, s in base)
    if ss <= 0 or bs <= 0 or bt <= 0 or st <= 0:
        return None
    return (st / ss) / (bt / bs)


def mean_of_ratios(spec: Sequence[Pair], base: Sequence[Pair]) -> float | None:
    """The mean over prompts of each prompt's tokens/s ratio (Spec-Bench's per-question figure)."""
    ratios = [(t / s) / (bt / bs) for (t, s), (bt, bs) in zip(spec, base) if s > 0 and bs > 0 and t > 0 and bt > 0]
    return sum(ratios) / len(ratios) if ratios else None


def bootstrap_interval(spec: Sequence[Pair], base: Sequence[Pair], n_resamples: int = 2000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float] | None:
    """The percentile bootstrap interval of :func:`ratio_of_means` over prompts (pairs resampled together);
    None with fewer than 2 prompts (no spread to measure)."""
    if len(spec) != len(base):
        raise ValueError(f"bootstrap_interval: {len(spec)} speculative prompts but {len(base)} plain ones")
    n = len(spec)
    if n < 2 or ratio_of_means(spec, base) is None:
        return None
    rng = random.Random(seed)
    stats = []
    for _ in range(n_resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        r = ratio_of_means([spec[i] for i in idx], [base[i] for i in idx])
        if r is not None:
            stats.append(r)
    stats.sort()
    lo = stats[int((1 - level) / 2 * (len(stats) - 1))]
    hi = stats[int((1 + level) / 2 * (len(stats) - 1))]
    return lo, hi
