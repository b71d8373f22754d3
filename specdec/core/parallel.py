"""Parallel sampling (``SamplingParams.n > 1``) as n child requests, merged back into one output.

Each child is an independent request with ``n=1`` and seed ``seed + i`` (unseeded children when the
parent has no seed), so a seeded parent is reproducible and its children differ. The children are
submitted together, so they are admitted in one prefill step, where the worker prefills the prompt once
and copies its KV to the other children's slots (specdec/core/plain_worker.py, ``ModelEngine.copy_prefix``); each
child samples its first token from the shared last-row logits with its own seed, so the tokens are
exactly those of n separate requests. Knows nothing about engines: it maps parameters and outputs.
"""

from __future__ import annotations

import msgspec

from specdec.datamodel.outputs import RequestOutput
from specdec.datamodel.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of child ``index`` of ``params`` (``n=1``, seed ``seed + index``)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % (2**63)
    return msgspec.structs.replace(params, n=1, seed=seed)


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def merge_outputs(parent_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput with the children's completions as ``outputs[0..n-1]`` (index = child index).
    Metrics and latency are the first child's; the first error is kept."""
    first = children[0]
    outs = []
    for i, child in enumerate(children):
        for comp in child.outputs:
            outs.append(msgspec.structs.replace(comp, index=i))
    return msgspec.structs.replace(first, request_id=parent_id, outputs=outs,
                                   finished=all(c.finished for c in children),
                                   error=next((c.error for c in children if c.error), None))
