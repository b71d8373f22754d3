"""Typical acceptance (Medusa, Cai et al. 2024, sec. 3.3.1), with vLLM v0's TypicalAcceptanceSampler rule.

Draft token x at a position is accepted iff
    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))),   H(p) = -sum p log(p + 1e-5).
The first rejected position emits the target's argmax (deterministic), so position 0 always emits a
token: the draft if it is accepted, else argmax p. LOSSY: the output is not distributed as p.
"""

from __future__ import annotations

import torch

# vLLM v0 adds this inside the log so that p = 0 terms contribute 0 instead of NaN.
_ENTROPY_EPS = 1e-5


def typical_accept_ref(target_probs: torch.Tensor,  # [B, K, V] float, K >= k (bonus row ignored)
                       draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding (never accepted)
                       posterior_threshold: float,
                       posterior_alpha: float,
                       ) -> torch.Tensor:  # [B, k] bool, position-wise
    k = draft_token_ids.shape[1]
    p = target_probs[:, :k]  # [B, k, V]
    p_x = p.gather(-1, draft_token_ids.clamp(min=0)[..., None]).squeeze(-1)  # [B, k]
    entropy = -(p * torch.log(p + _ENTROPY_EPS)).sum(dim=-1)  # [B, k]
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    return (p_x > threshold) & (draft_token_ids >= 0)
