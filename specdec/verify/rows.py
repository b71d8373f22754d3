"""Row bookkeeping shared by the chain and tree verifiers: which rows of a batch are greedy and which
sample, and how many drafts a chain's output accepted. Knows nothing about models or request state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec.sampling.sampler import SamplingTensors
from specdec.datamodel.sampling_params import SamplingParams

__all__ = ["RowSplit", "num_accepted_tokens", "split_rows"]


@dataclass
class RowSplit:
    """A batch's rows split into greedy ones (exact matching) and random ones (the sampling rule)."""

    st: SamplingTensors | None  # every row; None when every row is greedy (nothing reads it then)
    rows: list[int]  # the random rows (temperature > 0), ascending
    st_random: SamplingTensors | None  # ``st`` restricted to them, marked all-random; None when there are none

    def generators(self, generators: Sequence[torch.Generator | None] | None) -> dict[int, torch.Generator]:
        """index among the random rows -> its generator (seeded requests only)."""
        if generators is None:
            return {}
        return {j: generators[r] for j, r in enumerate(self.rows) if generators[r] is not None}


def split_rows(params: Sequence[SamplingParams], device: torch.device | str) -> RowSplit:
    if all(p.temperature == 0.0 for p in params):  # greedy batches build no tensors (a step's Python is cold)
        return RowSplit(None, [], None)
    st = SamplingTensors.from_params(params, device=device)
    if st.all_random:
        return RowSplit(st, list(range(len(params))), st)
    rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if not rows:
        return RowSplit(st, rows, None)
    sel = replace(st.select(torch.tensor(rows, device=device)), all_greedy=False, all_random=True)
    return RowSplit(st, rows, sel)


def num_accepted_tokens(output_token_ids: torch.Tensor,  # [B, k+1] int64, -1 after the emitted tokens
                        ) -> torch.Tensor:  # [B] int64 accepted drafts per row (emitted - 1)
    return (output_token_ids != -1).sum(dim=1) - 1

