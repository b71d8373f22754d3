"""Logit transforms of per-request sampling parameters, one row per token: [N, V] -> [N, V].

Order (vLLM v0): temperature, then top-k / top-p, then min-p; masked logits become -inf and the caller
takes the softmax. Temperature 0 (greedy) rows are divided by 1 here: the caller replaces them by a
one-hot argmax. Knows nothing about SamplingParams: every parameter is a per-row tensor.
"""

from __future__ import annotations

import torch


def apply_temperature_ref(logits: torch.Tensor,  # [N, V] float
                          temperature: torch.Tensor,  # [N] float, 0 = greedy (left unscaled)
                          ) -> torch.Tensor:  # [N, V]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t.to(logits.dtype)[:, None]


def apply_top_k_top_p_ref(logits: torch.Tensor,  # [N, V] float
                          top_k: torch.Tensor | None,  # [N] int64; <= 0 or >= V = off; None = off for all
                          top_p: torch.Tensor | None,  # [N] float in (0, 1]; 1 = off; None = off for all
                          ) -> torch.Tensor:  # [N, V], tokens outside the top-k / nucleus set to -inf
    """Top-k keeps every token tied with the k-th largest; top-p keeps the smallest set of most likely
    tokens (after top-k) whose mass reaches top_p, always at least the most likely one."""
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if top_k is not None:
        top_k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
    if top_p is None and int(top_k.max()) < V:
        # top-k alone, every row on: a partial top-k (max k over rows) instead of a full sort
        kth_vals = logits.topk(int(top_k.max()), dim=-1).values  # [N, max_k] descending
        kth = kth_vals.gather(-1, (top_k - 1)[:, None])  # [N, 1]
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(-1, (V - top_k)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is None:
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    # drop the low tail whose cumulative mass is <= 1 - top_p; never the most likely token (last)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p.to(cum.dtype))[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p_ref(logits: torch.Tensor,  # [N, V] float
                    min_p: torch.Tensor,  # [N] float in [0, 1]; 0 = off
                    ) -> torch.Tensor:  # [N, V], tokens with p < min_p * max(p) set to -inf
    # p_i / p_max = exp(l_i - l_max): compare in logit space, no softmax needed
    cutoff = logits.max(dim=-1, keepdim=True).values + torch.log(min_p.to(logits.dtype))[:, None]
    return logits.masked_fill(logits < cutoff, float("-inf"))
