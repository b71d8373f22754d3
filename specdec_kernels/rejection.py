"""Lossless (rejection) verification of a k-token proposal, Leviathan et al. 2023 / Chen et al. 2023.

Position i of row b holds draft token x ~ q_i; the target's distribution there is p_i.
- accept x with probability min(1, p_i(x) / q_i(x))   (q_i(x) <= p_i(x): always accept);
- at the first rejected position n, emit the **recovered** token ~ norm(max(p_n - q_n, 0));
- if all k are accepted, emit the **bonus** token ~ p_k.
The emitted tokens are then distributed exactly as sampling from p one token at a time.

Conventions shared by every backend:
- ``draft_probs=None`` means a proposer without probabilities (n-gram): q is one-hot at the drafted token,
  so x is accepted with probability p(x) and the recovered token is drawn from p with x removed.
- ``draft_token_ids == -1`` pads a proposal shorter than k: never accepted, and q counts as 0 there,
  so the token emitted at the first padded position is plain sampling from p.
- Only one recovered-or-bonus token per row is ever emitted, so one [B, V] exponential noise row serves
  both (``sample_recovered`` at ``position == k`` samples the bonus from p_k): no second [B, k, V] tensor.
Knows nothing about sampling parameters: p and q arrive already temperature-scaled and filtered.
"""

from __future__ import annotations

import torch


def rejection_accept_ref(target_probs: torch.Tensor,  # [B, K, V] float, K >= k (bonus row ignored)
                         draft_probs: torch.Tensor | None,  # [B, k, V] float, or None = one-hot drafts
                         draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                         uniform: torch.Tensor,  # [B, k] float32 in [0, 1)
                         ) -> torch.Tensor:  # [B, k] bool, position-wise (only the prefix counts)
    k = draft_token_ids.shape[1]
    ids = draft_token_ids.clamp(min=0)[..., None]  # [B, k, 1]
    p_x = target_probs[:, :k].gather(-1, ids).squeeze(-1)  # [B, k]
    # u < min(1, p/q)  <=>  u * q < p  (u < 1); no division, and q(x) = 0 accepts iff p(x) > 0.
    if draft_probs is None:
        accepted = uniform < p_x
    else:
        accepted = uniform * draft_probs.gather(-1, ids).squeeze(-1) < p_x
    return accepted & (draft_token_ids >= 0)


def sample_recovered_ref(target_probs: torch.Tensor,  # [B, K, V] float, K = k or k+1
                         draft_probs: torch.Tensor | None,  # [B, k, V] float, or None = one-hot drafts
                         draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                         position: torch.Tensor,  # [B] int64 in [0, K): where to sample (first rejection)
                         exp_noise: torch.Tensor,  # [B, V] float32 Exp(1) noise, > 0
                         ) -> torch.Tensor:  # [B] int64 ~ norm(max(p - q, 0)) at `position` (p at k)
    B, k = draft_token_ids.shape
    rows = torch.arange(B, device=target_probs.device)
    p = target_probs[rows, position]  # [B, V]
    if k == 0:
        weights = p
    else:
        pos = position.clamp(max=k - 1)
        tok = draft_token_ids[rows, pos]  # [B]
        has_q = (position < k) & (tok >= 0)  # [B]: the bonus position and padding have q = 0
        if draft_probs is None:
            # max(p - onehot(x), 0) is p with x removed (p(x) <= 1)
            removed = torch.zeros_like(p, dtype=torch.bool)
            removed[rows, tok.clamp(min=0)] = has_q
            weights = p.masked_fill(removed, 0.0)
        else:
            q = draft_probs[rows, pos]  # [B, V]
            weights = (p - q * has_q[:, None].to(q.dtype)).clamp_(min=0.0)
        # A rejection where max(p - q, 0) = 0 everywhere (p == q up to rounding) has probability 0;
        # if rounding produced one anyway, fall back to p rather than sample from nothing.
        empty = weights.sum(dim=-1, keepdim=True) <= 0
        weights = torch.where(empty, p, weights)
    # exponential race: argmax(w / E) ~ w / sum(w), no normalisation needed
    return (weights / exp_noise).argmax(dim=-1)
