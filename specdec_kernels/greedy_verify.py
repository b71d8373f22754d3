"""Greedy verification: accept drafts while they equal the target's argmax.

The emitted tokens are exactly the target's argmax up to and including the first mismatch (or the
bonus argmax at position k when every draft matched), because an accepted draft *is* the argmax.
Padded drafts (-1, proposal shorter than k) never match.
"""

from __future__ import annotations

import torch


def greedy_verify_ref(target_argmax: torch.Tensor,  # [B, k+1] int64 target argmax at each position
                      draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                      ) -> torch.Tensor:  # [B, k+1] int64, -1 after the first mismatch
    B, k1 = target_argmax.shape
    if draft_token_ids.shape != (B, k1 - 1):
        raise ValueError(f"greedy_verify: draft_token_ids has shape {tuple(draft_token_ids.shape)}, "
                         f"expected [{B}, {k1 - 1}] for target_argmax of shape [{B}, {k1}].")
    match = draft_token_ids == target_argmax[:, :-1]  # [B, k]
    n = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] accepted prefix length
    pos = torch.arange(k1, device=target_argmax.device)
    return target_argmax.to(torch.int64).masked_fill(pos > n[:, None], -1)
