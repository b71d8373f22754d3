"""The plug-in contract of a draft method. A proposer only makes tokens.

It does not decide k per sequence, pad, or handle the batch-size cut-off: Top1Proposer does that once.
It keeps whatever per-sequence state it likes (a draft KV slot, an n-gram index), told about accepted
tokens through :meth:`Proposer.verified` and about finished sequences through :meth:`Proposer.free`; a
step that fails is undone through :meth:`Proposer.snapshot` / :meth:`Proposer.restore`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specdec.engine import ModelEngine
    from specdec.sampling_params import SamplingParams
    from specdec.sequence import HiddenStates
    from specdec.spec_decode.config import SpeculativeConfig


@dataclass
class ProposeBatch:
    """The sequences to draft for this step (only those with k > 0), all drafting the same k."""

    seq_ids: list[int]  # [B]
    token_ids: list[list[int]]  # [B] each sequence's full tokens (prompt + output); the last is pending
    k: int  # draft tokens wanted per sequence
    sampling_params: list["SamplingParams"]  # [B] (temperature 0 = greedy: draft greedily too)
    generators: list[torch.Generator | None]  # [B] per-request generators (seeded requests)
    # the target's hidden states, one row per token the proposer has not yet seen (a bonus sequence has
    # two: the last accepted draft and the bonus), as threaded by the worker; None unless asked for
    hidden_states: "HiddenStates | None" = None
    seq_ids_with_bonus_token_in_last_step: frozenset[int] = frozenset()


@dataclass
class DraftOutput:
    token_ids: torch.Tensor  # [B, k] int64; -1 past a sequence's length
    probs: torch.Tensor | None  # [B, k, V] float32 draft distribution q each token was sampled from;
    #                             None = deterministic drafts (q is one-hot at the token)
    lens: torch.Tensor | None = None  # [B] int64 tokens actually proposed (None = k for all)


class Proposer(ABC):
    """Base class of every draft method. Subclasses set ``needs_hidden_states`` when they read them."""

    needs_hidden_states: bool = False

    def __init__(self, target: "ModelEngine", config: "SpeculativeConfig") -> None:
        self.target = target
        self.config = config

    @abstractmethod
    def propose(self, batch: ProposeBatch) -> DraftOutput:
        """Draft ``batch.k`` tokens after each sequence's last (pending) token."""

    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        """The first ``num_valid_tokens`` tokens of the sequence are final and equal to what the proposer
        was fed (the prefix plus the accepted drafts); anything it cached past them is stale."""

    def free(self, seq_id: int) -> None:
        """The sequence finished or was aborted: release its state."""

    def snapshot(self, seq_ids: list[int]) -> Any:
        """Taken before every step: what :meth:`restore` needs to undo the step for these sequences."""
        return None

    def restore(self, seq_ids: list[int], snapshot: Any) -> None:
        """The step raised or was interrupted: put the sequences' state back as :meth:`snapshot` saw it.

        The default frees them: exact for a stateless proposer, and safe for one that (like every
        proposer here) rebuilds its state lazily from the tokens it is given. Override it to restore
        exactly, so that a rolled-back step leaves the next drafts bit-identical."""
        for seq_id in seq_ids:
            self.free(seq_id)
