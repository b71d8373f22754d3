"""The per-request speculative metrics a client asks for with ``"return_spec_decode_metrics": true``.

Sent as a top-level ``spec_decode_metrics`` object: in the response body (non-streaming), or in the last chunk, the
one that carries the usage (streaming; sent whether or not ``stream_options.include_usage`` was asked). Summed over
the response's prompts and choices as ``usage`` is, from each finished request's
``RequestMetrics.spec_token_acceptance_counts`` (specdec.datamodel.metrics states the conventions once; names as
there: ``mean_acceptance_length`` includes the bonus token, ``acceptance_per_position[i]`` = share of decode steps
that accepted draft i). ``null`` where undefined (no decode step); on a server that does not speculate every
decode step still counts (no accepted tokens, mean_acceptance_length 1.0). With n > 1 the first choice's counts
stand for its prompt (RequestOutput.metrics is the first child's).
Also from ``RequestMetrics``: ``num_draft_tokens`` (draft tokens or tree nodes proposed), ``acceptance_rate``
(accepted / drafted, ``null`` when nothing was drafted), and the speculation policy's choices (specdec/spec_decode/
policy.py): ``chosen_k_histogram[k]`` = decode steps at k (a tree: node budget; 0 = speculation off for that step)
and their mean ``mean_chosen_k``.
Knows nothing about HTTP.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from specdec.datamodel.metrics import aggregate_counts, sum_counts
from specdec.datamodel.outputs import RequestOutput


def spec_decode_metrics(finals: Iterable[RequestOutput]) -> dict[str, Any]:
    counts = sum_counts([o.metrics.spec_token_acceptance_counts for o in finals
                         if o.metrics is not None and o.metrics.spec_token_acceptance_counts])
    m = aggregate_counts(counts)

    def num(x: float) -> float | None:
        return None if math.isnan(x) else x

    metrics = [o.metrics for o in finals if o.metrics is not None]
    drafted = sum(x.num_draft_tokens for x in metrics)
    chosen = sum_counts([x.chosen_k_counts for x in metrics if x.chosen_k_counts])
    steps_chosen = sum(chosen)
    return {"num_steps": m.num_steps, "num_draft_tokens": drafted, "num_accepted_tokens": m.num_accepted_tokens,
            "num_emitted_tokens": m.num_emitted_tokens, "acceptance_counts": m.acceptance_counts,
            "acceptance_per_position": m.acceptance_per_position,
            "acceptance_rate": m.num_accepted_tokens / drafted if drafted else None,
            "mean_acceptance_length": num(m.mean_acceptance_length),
            "chosen_k_histogram": chosen if steps_chosen else [],
            "mean_chosen_k": sum(k * c for k, c in enumerate(chosen)) / steps_chosen if steps_chosen else None}
