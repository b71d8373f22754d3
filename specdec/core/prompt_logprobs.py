"""Prompt logprobs (``SamplingParams.prompt_logprobs``): one extra forward of the prompt on a scratch KV slot.

The worker computes logits only at each sequence's last position, so the prompt's own logprobs come from a
separate prefill over the whole prompt (all T rows of logits) in a slot that is freed at once. It costs one
more prefill for the requests that ask, and changes nothing else: the request's own prefill and sampling are
untouched, so the output tokens are the same with or without it. Knows nothing about scheduling.
"""

from __future__ import annotations

import torch

from specdec.engine import ForwardBatch
from specdec.datamodel.sequence import Logprob


def score_prompt(engine, token_ids: list[int], num: int) -> list[dict[int, Logprob] | None]:
    """Per prompt token: None for the first, else {its id: Logprob(logprob, rank), the ``num`` most likely
    ids: ...} under log_softmax of the target's raw logits at the position before it."""
    if len(token_ids) < 2:
        return [None] * len(token_ids)
    slot = engine.allocate_slot()
    try:
        ids = torch.tensor(token_ids, dtype=torch.long, device=engine.device)  # [T]
        out = engine.forward(ForwardBatch(token_ids=ids, slots=[slot], query_lens=[len(token_ids)]))
    finally:
        engine.rollback(slot, 0)
        engine.free_slot(slot)
    lp = torch.log_softmax(out.logits[:-1].float(), dim=-1)  # [T-1, V]: row i predicts token i+1
    nxt = ids[1:, None]  # [T-1, 1]
    chosen = lp.gather(1, nxt)  # [T-1, 1]
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()  # [T-1]
    top_vals, top_ids = lp.topk(num, dim=-1) if num else (None, None)  # [T-1, num]
    result: list[dict[int, Logprob] | None] = [None]
    for i, tok in enumerate(token_ids[1:]):
        d: dict[int, Logprob] = {}
        if num:
            for r, (t, v) in enumerate(zip(top_ids[i].tolist(), top_vals[i].tolist()), start=1):
                d[t] = Logprob(v, r)
        d.setdefault(tok, Logprob(float(chosen[i, 0]), ranks[i]))
        result.append(d)
    return result
