"""The theory beside every measured figure: what the measured acceptance and step costs predict.

Pure functions over acceptance counts and mean phase times; knows nothing about engines, runs or W&B.

Acceptance (``counts`` = summed ``spec_token_acceptance_counts``, positions 0..k, see specdec/datamodel/metrics.py):

- ``alpha_per_position[i-1]`` = alpha_i = counts[i] / counts[i-1]: the **conditional** rate, position i
  accepted given positions < i were (None where no step reached position i). ``acceptance_per_position``
  is the unconditional share counts[i] / counts[0] = prod_{j<=i} alpha_j. A step that proposed nothing
  (an n-gram miss) counts as a rejection at position 1: the counts do not tell the two apart.
- ``predicted_tau`` (product form) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j. Over the counts it was
  measured on it telescopes to sum(counts) / counts[0], the measured tau: it is the position-wise
  reference that the i.i.d. form is read against, and a check that the counts are prefix-shaped.
- ``predicted_tau_iid`` = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding", eq. 1; k + 1 at a = 1), with a = ``alpha_iid`` fitted by
  maximum likelihood: each position a step reaches is one Bernoulli trial, so
  a = accepted / trials = sum_{i=1..k} counts[i] / sum_{i=1..k} counts[i-1] (the MLE of a geometric
  acceptance length truncated at k).

For a tree (``scorer=tree``) the counts count accepted depths and k = its longest path (the tree depth, or a grafted
branch's length past it: Top1Proposer.max_path); c is then the draft's cost per position of that path.

Cost (Leviathan et al. 2023 section 3.4; the EAGLE papers, Li et al. 2024, use the same model): one
speculative step costs t1 * (v + k c) and emits tau tokens, where t1 is the cost of a one-token target
forward, so the predicted speedup over plain decoding (one token per t1) is tau / (v + k c).

- t1 = the plain baseline's mean decode step in the same run (forward + sampling of one token + the step
  loop: the one-token forward is not timed alone, so t1 carries the plain step's small overheads);
- ``verify_cost`` v = mean ``score`` phase (the target forward over the scored tokens: k + 1 for a chain,
  the tree's nodes + 1 for a tree) / t1. The ``verify`` phase (rejection sampling, KV rollback, hidden
  state threading) and the rest of the step loop are **not** folded into v: the theory does not model
  them, so they show up as ``efficiency`` < 1;
- ``draft_cost`` c = mean ``propose`` phase / k / t1 (one draft step; k c is the whole propose phase,
  however the proposer spends it: k forwards, one head pass or an n-gram lookup);
- ``predicted_speedup`` = predicted_tau / (v + k c);
- ``efficiency`` = measured speedup / predicted_speedup: the share of the modelled gain the framework
  delivers (below 1: verification, bookkeeping, prefill and other time outside propose and score).
"""

from __future__ import annotations

import msgspec


class Theory(msgspec.Struct, kw_only=True):
    """The predicted figures of one set of counts and times; None where an input is missing (no
    speculation, no baseline). summary.py's CategorySummary and RunSummary carry these fields by name."""

    alpha_per_position: list[float | None] = msgspec.field(default_factory=list)  # alpha_i, i = 1..k
    alpha_iid: float | None = None  # the i.i.d. acceptance a fitted to the counts (MLE)
    predicted_tau: float | None = None  # 1 + sum_i prod_{j<=i} alpha_j (product form)
    predicted_tau_iid: float | None = None  # (1 - a^(k+1)) / (1 - a)
    verify_cost: float | None = None  # v = mean score phase / t1
    draft_cost: float | None = None  # c = mean propose phase / k / t1
    predicted_speedup: float | None = None  # predicted_tau / (v + k c)
    efficiency: float | None = None  # measured speedup / predicted_speedup


def _padded(counts: list[int], k: int) -> list[int]:
    """counts as k + 1 entries: a position no request's counter reached was accepted 0 times."""
    if len(counts) > k + 1:
        raise ValueError(f"theory: acceptance counts {counts} have {len(counts) - 1} draft positions but k={k}; "
                         "pass k = the engine's num_speculative_tokens (a tree's longest path)")
    return list(counts) + [0] * (k + 1 - len(counts))


def conditional_acceptance(counts: list[int], k: int) -> list[float | None]:
    """alpha_i = counts[i] / counts[i-1] for i = 1..k; None where no step reached position i."""
    c = _padded(counts, k)
    return [c[i] / c[i - 1] if c[i - 1] else None for i in range(1, k + 1)]


def tau_product(alphas: list[float | None]) -> float:
    """1 + sum_i prod_{j<=i} alpha_j; an unreached position (None) and all after it add nothing."""
    tau, reach = 1.0, 1.0
    for a in alphas:
        if a is None:
            break
        reach *= a
        tau += reach
    return tau


def fit_alpha_iid(counts: list[int], k: int) -> float | None:
    """MLE of an i.i.d. per-position acceptance: accepted draft positions / positions reached."""
    c = _padded(counts, k)
    trials = sum(c[:k])
    return sum(c[1:]) / trials if trials else None


def tau_iid(a: float, k: int) -> float:
    """E[tau] = (1 - a^(k+1)) / (1 - a) for k drafts each accepted with probability a (Leviathan eq. 1)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"theory: acceptance a={a} is not a probability; fit it with fit_alpha_iid")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def speedup(tau: float, v: float, c: float, k: int) -> float:
    """tau / (v + k c): tokens per step over the step's cost in one-token target forwards."""
    return tau / (v + k * c)


def theory(counts: list[int], k: int, propose_s: float | None = None, score_s: float | None = None,
           one_token_s: float | None = None, measured_speedup: float | None = None) -> Theory:
    """All predicted figures from summed acceptance counts (positions 0..k) and mean phase seconds per
    speculative step (``propose_s``, ``score_s``) against the one-token forward ``one_token_s``."""
    alphas = conditional_acceptance(counts, k) if k > 0 else []
    a = fit_alpha_iid(counts, k) if k > 0 else None
    reached = bool(counts) and counts[0] > 0
    tau = tau_product(alphas) if (k > 0 and reached) else None
    timed = k > 0 and one_token_s is not None and one_token_s > 0 and propose_s is not None and score_s is not None
    v = score_s / one_token_s if timed else None
    c = propose_s / k / one_token_s if timed else None
    pred = speedup(tau, v, c, k) if (tau is not None and v is not None and v + k * c > 0) else None
    return Theory(
        alpha_per_position=alphas, alpha_iid=a, predicted_tau=tau,
        predicted_tau_iid=tau_iid(a, k) if a is not None else None, verify_cost=v, draft_cost=c,
        predicted_speedup=pred,
        efficiency=measured_speedup / pred if (pred and measured_speedup is not None) else None,
    )
