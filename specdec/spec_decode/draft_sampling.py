"""The draft sampler every proposer shares: one token per row from draft logits, and the q it came from.

Greedy rows (temperature 0) take the argmax. The others draw from q = the request's processed
distribution (temperature / top-k / top-p / min-p through ``SamplingTensors.to_probs`` on the chosen
kernel backend) by the exponential race (argmax q / E, E ~ Exp(1) from the request's generator when it
is seeded), and q is returned: rejection sampling is lossless only when q is exactly what each draft was
drawn from. Knows nothing about models or proposers.
"""

from __future__ import annotations

import torch

from specdec_kernels.noise import draw_exponential
from specdec.sampling.sampler import SamplingTensors, argmax_last


def sample_draft(logits: torch.Tensor,  # [B, V] draft logits (any float dtype)
                 st: SamplingTensors,  # [B] the rows' sampling parameters
                 generators: list[torch.Generator | None],  # [B]; None for unseeded and greedy rows
                 kernel: str = "torch",
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [B] int64, q [B, V] float32 | None
    """q is None when every row is greedy (the drafts are one-hot)."""
    logits = logits.float()
    if st.all_greedy:
        return argmax_last(logits), None
    q = st.to_probs(logits, kernel=kernel)  # greedy rows are one-hot at the argmax
    noise = draw_exponential(logits.shape[0], logits.shape[1], generators, device=logits.device)
    return (q / noise).argmax(dim=-1), q


def greedy_free(params: list, generators: list[torch.Generator | None]) -> list[torch.Generator | None]:
    """Greedy rows never advance their generator: their generator slot becomes None."""
    return [None if p.temperature == 0 else g for p, g in zip(params, generators)]
