"""Output placement: accepted prefix, then the recovered or bonus token, then -1.

    out[b, :n] = draft_token_ids[b, :n]         n = length of the accepted prefix of row b
    out[b, n]  = bonus[b] if n == k else recovered[b]
    out[b, n+1:] = -1

Knows nothing about how acceptance was decided (rejection, typical, greedy).
"""

from __future__ import annotations

import torch


def num_accepted_ref(accepted: torch.Tensor,  # [B, k] bool: position-wise acceptance
                     ) -> torch.Tensor:  # [B] int64: index of the first False (k if none)
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def create_output_ref(accepted: torch.Tensor,  # [B, k] bool position-wise (only the prefix counts)
                      draft_token_ids: torch.Tensor,  # [B, k] int64
                      recovered_token_ids: torch.Tensor,  # [B] int64: token at the first rejection
                      bonus_token_ids: torch.Tensor,  # [B] int64: token at position k if all accepted
                      ) -> torch.Tensor:  # [B, k+1] int64, -1 after the emitted tokens
    B, k = draft_token_ids.shape
    n = num_accepted_ref(accepted)  # [B]
    final = torch.where(n == k, bonus_token_ids.to(torch.int64), recovered_token_ids.to(torch.int64))  # [B]
    pos = torch.arange(k + 1, device=draft_token_ids.device)  # [k+1]
    drafts = torch.cat([draft_token_ids.to(torch.int64), final[:, None]], dim=1)  # [B, k+1]
    out = torch.where(pos < n[:, None], drafts, final[:, None])
    return out.masked_fill_(pos > n[:, None], -1)
