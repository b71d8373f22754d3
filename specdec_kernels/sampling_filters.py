"""Logit transforms of per-request sampling parameters, one row per token: [N, V] -> [N, V].

Order (vLLM v0): temperature, then top-k / top-p, then min-p; masked logits become -inf and the caller
takes the softmax. Temperature 0 (greedy) rows are divided by 1 here: the caller replaces them by a
one-hot argmax. Knows nothing about SamplingParams: every parameter is a per-row tensor.

Top-k and top-p are cut-offs on the logit value, so tokens tied with the last kept one are kept too:
- top-k keeps the tokens >= the k-th largest logit;
- top-p (applied to the top-k distribution) keeps the tokens >= the logit of the c-th most likely token,
  c = the fewest most-likely tokens whose mass reaches top_p (at least 1).
``apply_top_k_top_p_ref`` is the readable one-sort reference; ``apply_top_k_top_p`` gives the same
result from a partial top-k (a full sort of 8 x 49152 logits takes ~35 ms on this CPU).
"""

from __future__ import annotations

import torch

# Candidate counts the fast top-p tries, in turn, before a full sort of the rows still left: the nucleus
# of an LM's next-token distribution at top_p <= 0.95 is usually far smaller than 256. Measured here
# (1 thread, 8 x 49152): topk(256) 1.5 ms, topk(4096) 5.7 ms, a full sort 4.2 ms per row.
_TOP_P_CANDIDATES = (256, 4096)
_NEG_INF = float("-inf")


def apply_temperature_ref(logits: torch.Tensor,  # [N, V] float
                          temperature: torch.Tensor,  # [N] float, 0 = greedy (left unscaled)
                          ) -> torch.Tensor:  # [N, V]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t.to(logits.dtype)[:, None]


def _k_or_off(top_k: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k clamped to [1, V], on [N] bool); <= 0 or >= V is off."""
    on = (top_k > 0) & (top_k < V)
    return torch.where(on, top_k, torch.full_like(top_k, V)), on


def _top_p_count(sorted_desc: torch.Tensor,  # [N, M] logits, descending (masked ones -inf)
                 log_norm: torch.Tensor,  # [N, 1] logsumexp of the row's kept logits
                 top_p: torch.Tensor,  # [N]
                 ) -> torch.Tensor:  # [N] int64: fewest tokens whose mass reaches top_p (may be M + 1)
    cum = (sorted_desc - log_norm).exp().cumsum(dim=-1)  # [N, M] mass of the i+1 most likely
    return (cum < top_p.to(cum.dtype)[:, None]).sum(dim=-1) + 1


def apply_top_k_top_p_ref(logits: torch.Tensor,  # [N, V] float
                          top_k: torch.Tensor | None,  # [N] int64; <= 0 or >= V = off; None = off for all
                          top_p: torch.Tensor | None,  # [N] float in (0, 1]; 1 = off; None = off for all
                          ) -> torch.Tensor:  # [N, V], tokens outside the top-k / nucleus set to -inf
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    desc = logits.sort(dim=-1, descending=True).values  # [N, V]
    cutoff = torch.full_like(desc[:, :1], _NEG_INF)  # [N, 1] keep logits >= cutoff
    if top_k is not None:
        k, on = _k_or_off(top_k, V)
        cutoff = torch.where(on[:, None], desc.gather(1, (k - 1)[:, None]), cutoff)
        desc = desc.masked_fill(desc < cutoff, _NEG_INF)
    if top_p is not None:
        c = _top_p_count(desc, desc.logsumexp(dim=-1, keepdim=True), top_p).clamp(max=V)
        p_on = (top_p < 1)[:, None]  # top_p = 1 is off, whatever the rounding of the cumulative sum
        cutoff = torch.where(p_on, torch.maximum(cutoff, desc.gather(1, (c - 1)[:, None])), cutoff)
    return logits.masked_fill(logits < cutoff, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor,  # [N, V] float
                      top_k: torch.Tensor | None,  # [N] int64; <= 0 or >= V = off; None = off for all
                      top_p: torch.Tensor | None,  # [N] float in (0, 1]; 1 = off; None = off for all
                      ) -> torch.Tensor:  # [N, V]; same result as apply_top_k_top_p_ref, no full sort
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if top_p is None:
        k, on = _k_or_off(top_k, V)
        k_on = torch.where(on, k, torch.ones_like(k))
        vals = logits.topk(int(k_on.max()), dim=-1).values  # [N, max k] descending
        cutoff = torch.where(on[:, None], vals.gather(1, (k_on - 1)[:, None]), _NEG_INF)
        return logits.masked_fill(logits < cutoff, _NEG_INF)
    out = None
    rows = torch.arange(logits.shape[0], device=logits.device)
    for num_candidates in _TOP_P_CANDIDATES:
        cutoff, fits = _top_p_cutoff_from_candidates(logits, top_k, top_p, min(num_candidates, V))
        masked = logits.masked_fill(logits < cutoff, _NEG_INF)
        if out is None and bool(fits.all()):  # the common case: no row bookkeeping
            return masked
        out = torch.empty_like(logits) if out is None else out
        out[rows[fits]] = masked[fits]
        if bool(fits.all()):
            return out
        # only the rows whose nucleus did not fit go on to more candidates, then to the full sort
        keep = ~fits
        rows, logits = rows[keep], logits[keep]
        top_k = None if top_k is None else top_k[keep]
        top_p = top_p[keep]
    out[rows] = apply_top_k_top_p_ref(logits, top_k, top_p)
    return out


def _top_p_cutoff_from_candidates(logits: torch.Tensor,  # [N, V]
                                  top_k: torch.Tensor | None,  # [N] int64 or None
                                  top_p: torch.Tensor,  # [N]
                                  M: int,  # candidates: the M largest logits of each row
                                  ) -> tuple[torch.Tensor, torch.Tensor]:  # cutoff [N, 1], fits [N] bool
    """The reference's cut-off computed from the M largest logits, and whether that was enough."""
    N, V = logits.shape
    vals = logits.topk(M, dim=-1).values  # [N, M] descending
    cutoff = torch.full_like(vals[:, :1], _NEG_INF)
    log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [N, 1] mass normaliser of rows without top-k
    fits = torch.ones(N, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        k, on = _k_or_off(top_k, V)
        kth = vals.gather(1, (k.clamp(max=M) - 1)[:, None])  # [N, 1]
        # the whole top-k set, ties included, must be among the candidates for its mass to be known
        fits &= ~(on & ((k > M) | ((M < V) & (vals[:, M - 1] >= kth[:, 0]))))
        cutoff = torch.where(on[:, None], kth, cutoff)
        vals = vals.masked_fill(vals < cutoff, _NEG_INF)
        log_norm = torch.where(on[:, None], vals.logsumexp(dim=-1, keepdim=True), log_norm)
    c = _top_p_count(vals, log_norm, top_p)  # [N]
    p_on = top_p < 1
    fits &= (c <= M) | (M == V) | ~p_on  # the nucleus lies inside the candidates
    cutoff = torch.where(p_on[:, None], torch.maximum(cutoff, vals.gather(1, (c.clamp(max=M) - 1)[:, None])),
                         cutoff)
    return cutoff, fits


def apply_min_p_ref(logits: torch.Tensor,  # [N, V] float
                    min_p: torch.Tensor,  # [N] float in [0, 1]; 0 = off
                    ) -> torch.Tensor:  # [N, V], tokens with p < min_p * max(p) set to -inf
    # p_i / p_max = exp(l_i - l_max): compare in logit space, no softmax needed
    cutoff = logits.max(dim=-1, keepdim=True).values + torch.log(min_p.to(logits.dtype))[:, None]
    return logits.masked_fill(logits < cutoff, _NEG_INF)
