"""Per-token expansion of per-request values: [B, ...] -> [B * (k+1), ...] (row b repeated k+1 times).

Used to give every scored position (k drafts + bonus) its request's sampling parameters.
"""

from __future__ import annotations

import torch


def expand_per_token_ref(x: torch.Tensor,  # [B, ...] one value per request
                         num_tokens: int | torch.Tensor,  # int, or [B] int64 tokens per request
                         ) -> torch.Tensor:  # [sum(num_tokens), ...] request-major: b0 b0 .. b1 b1 ..
    if isinstance(num_tokens, int):
        if num_tokens < 0:
            raise ValueError(f"expand_per_token: num_tokens={num_tokens} must be >= 0.")
        return torch.repeat_interleave(x, num_tokens, dim=0, output_size=x.shape[0] * num_tokens)
    if num_tokens.shape != (x.shape[0],):
        raise ValueError(f"expand_per_token: num_tokens has shape {tuple(num_tokens.shape)}, "
                         f"expected [{x.shape[0]}] (one count per row of x).")
    return torch.repeat_interleave(x, num_tokens.to(device=x.device), dim=0)
