"""Logprobs of emitted tokens, from the RAW target logits (before processors and temperature, as vLLM
reports them): the one definition for plain steps (specdec/core/plain_worker.py) and speculative ones
(the rows of the accepted path), so both give the same dicts. Knows nothing about models or requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Logprob
from specdec.interfaces import Verdict

__all__ = ["chosen_logprobs", "emitted_logprobs", "position_logprobs"]


def _emitted_index(verdict: Verdict) -> tuple[list[int], list[int], list[int], list[int]]:
    """Where the emitted tokens sit, as lists (a step has a few): (row b [E], node [E], token [E], counts [B] =
    n_acc + 1 per sequence, E = sum(counts)), the accepted path's nodes in order."""
    paths, outs = verdict.accepted_paths, verdict.out.tolist()
    counts = [len(pr) for pr in paths]  # n_acc + 1
    b, node, tok = [], [], []
    for r, (pr, orow, c) in enumerate(zip(paths, outs, counts)):
        b += [r] * c
        node += pr
        tok += orow[:c]
    return b, node, tok, counts


def _emitted_rows(logits: torch.Tensor,  # [B, M, V] raw target logits, root-inclusive
                  verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(rows [E, V] the logits at each emitted position: the accepted path's nodes, ``verdict.path``;
    tokens [E] emitted there; counts [B] = n_acc + 1 per sequence, E = sum(counts)): one index op gathers the
    rows."""
    b, node, tok, counts = _emitted_index(verdict)
    dev = logits.device
    if len(counts) == 1:  # one sequence: a plain row gather (~4x cheaper than the advanced index)
        rows = logits[0].index_select(0, torch.tensor(node, device=dev))  # [E, V]
    else:
        rows = logits[torch.tensor(b, device=dev), torch.tensor(node, device=dev)]  # [E, V]
    return rows, torch.tensor(tok, dtype=torch.int64, device=dev), counts


def chosen_logprobs(logits: torch.Tensor,  # [B, M, V] raw target logits, root-inclusive
                    verdict: Verdict,
                    lse: torch.Tensor | None = None,  # [B, M] logsumexp of each row, when the engine took it
                    ) -> list[list[float]]:  # per row: n_acc+1 values
    """log_softmax(raw logits)[emitted token] at each emitted position: the accepted path's rows only
    (<= depth+1 per sequence), not all B * M. With ``lse`` given only the emitted tokens' logits are read."""
    if lse is not None:
        b, node, tok, counts = _emitted_index(verdict)
        if logits.device.type == "cpu" and logits.dtype == lse.dtype == torch.float32:
            # numpy views, read element by element: the same fp32 difference without a tensor op per index (a
            # step's Python runs with caches cold from the forward, where each tensor op costs ~20-50 us)
            L, S = logits.detach().numpy(), lse.detach().numpy()
            lp = [float(L[i, n, t] - S[i, n]) for i, n, t in zip(b, node, tok)]
        else:
            bi, ni = torch.tensor(b), torch.tensor(node)
            lp = (logits[bi, ni, torch.tensor(tok)] - lse[bi, ni]).tolist()
    else:
        rows, tok_t, counts = _emitted_rows(logits, verdict)
        lp = (rows.gather(1, tok_t[:, None])[:, 0] - torch.logsumexp(rows, -1)).tolist()
    starts = [0, *itertools.accumulate(counts)]
    return [lp[starts[i]:starts[i + 1]] for i in range(len(counts))]


def position_logprobs(rows: torch.Tensor,  # [E, V] raw target logits at E emitted positions
                      tokens: Sequence[int],  # [E] the token emitted at each (-1: none, the row was not finite)
                      params: Sequence[SamplingParams],  # [E] each position's request
                      ) -> list[dict[int, Logprob]]:
    """Per position, what a request's ``logprobs`` and ``logprob_token_ids`` ask for, from log_softmax of
    the RAW logits (before processors and temperature, as the sampler reports them): the top ``logprobs``
    ids with rank 1..n, the emitted token and every ``logprob_token_ids`` id (rank None when outside the
    top n). The one definition for plain steps (specdec/core/plain_worker.py) and speculative ones (rows =
    ``verdict.path``'s), so the two give the same dicts."""
    lse = torch.logsumexp(rows.float(), -1, keepdim=True)  # [E, 1]
    n = min(max((p.logprobs or 0) for p in params), rows.shape[-1])
    top_vals, top_ids = rows.float().topk(n, dim=-1) if n else (rows[:, :0], rows[:, :0].long())  # [E, n]
    top_vals, top_ids = (top_vals - lse).tolist(), top_ids.tolist()
    want = [sorted({max(int(t), 0), *(p.logprob_token_ids or [])}) for t, p in zip(tokens, params)]
    width = max(len(w) for w in want)
    idx = torch.tensor([w + w[:1] * (width - len(w)) for w in want], device=rows.device)  # [E, width] padded
    vals = (rows.float().gather(1, idx) - lse).tolist()  # [E, width]
    out = []
    for e, p in enumerate(params):
        k = p.logprobs or 0
        d = {t: Logprob(logprob=v, rank=r) for r, (t, v) in enumerate(zip(top_ids[e][:k], top_vals[e][:k]), start=1)}
        for t, v in zip(want[e], vals[e]):
            d.setdefault(t, Logprob(logprob=v))
        out.append(d)
    return out


def emitted_logprobs(logits: torch.Tensor,  # [B, M, V] raw target logits, root-inclusive
                     verdict: Verdict, params: Sequence[SamplingParams],  # [B]
                     lse: torch.Tensor | None = None,  # [B, M] logsumexp of each row, when the engine took it
                     ) -> list[list[dict[int, Logprob]]]:  # per sequence: n_acc+1 dicts
    """The logprob dict of every emitted token: position_logprobs of the accepted path's rows for the
    sequences whose request asks (SamplingParams.wants_logprobs), else just the emitted token's."""
    if not any(p.wants_logprobs for p in params):
        toks = verdict.out.tolist()
        return [[{t: Logprob(logprob=v)} for t, v in zip(toks[b], lps)]
                for b, lps in enumerate(chosen_logprobs(logits, verdict, lse))]
    rows, tok, counts = _emitted_rows(logits, verdict)
    flat = position_logprobs(rows, tok.tolist(), [p for p, c in zip(params, counts) for _ in range(c)])
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    return [flat[starts[b]:starts[b + 1]] for b in range(len(counts))]

