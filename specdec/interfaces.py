"""The interfaces of one speculative step (after vLLM v0 spec_decode/interfaces.py).

propose -> score -> verify:
  SpeculativeProposer.get_spec_proposals(req, seq_ids_with_bonus_token_in_last_step) -> SpeculativeProposals
  SpeculativeScorer.score_proposals(req, proposals) -> SpeculativeScores
and the worker contract every step runner (plain or speculative) meets: ExecuteModelRequest -> StepOutput.
Implementations live in proposers/, scorers/ and specdec/spec_decode_worker.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.sequence import ExecuteModelRequest, Logprob


@dataclass
class SpeculativeProposals:
    """Draft tokens for a batch of B sequences, padded to k."""

    proposal_token_ids: torch.Tensor  # [B, k] int64; -1 past a sequence's proposal_len
    proposal_probs: torch.Tensor  # [B, k, V] float32 draft probabilities q (one-hot when the draft has none)
    proposal_lens: torch.Tensor  # [B] int64, 0..k; 0 = no speculation for this sequence this step
    no_proposals: bool = False  # True when no sequence got a proposal (the step decodes normally)


@dataclass
class SpeculativeScores:
    """The target's view of the proposals: k+1 positions per sequence (k drafts + one bonus)."""

    probs: torch.Tensor  # [B, k+1, V] float32 target probabilities (temperature etc. applied by the verifier)
    logprobs: torch.Tensor  # [B, k+1, V] float32 log_softmax of the raw target logits
    token_ids: torch.Tensor  # [B, k+1] int64 target argmax at each position
    hidden_states: torch.Tensor | None = None  # [B, k+1, D] last-layer hidden states, for EAGLE/Medusa
    logits: torch.Tensor | None = None  # [B, k+1, V] raw target logits (the verifier's input)


class SpeculativeProposer(ABC):
    @abstractmethod
    def get_spec_proposals(
        self,
        execute_model_req: ExecuteModelRequest,
        seq_ids_with_bonus_token_in_last_step: set[int],
    ) -> SpeculativeProposals:
        raise NotImplementedError


class SpeculativeScorer(ABC):
    @abstractmethod
    def score_proposals(
        self,
        execute_model_req: ExecuteModelRequest,
        proposals: SpeculativeProposals,
    ) -> SpeculativeScores:
        raise NotImplementedError


@dataclass
class GroupStepOutput:
    """What one step produced for one sequence group."""

    token_ids: list[int]  # emitted tokens, 1..k+1 (empty when the step failed for this group)
    logprobs: list[dict[int, Logprob]] | None = None  # per emitted token, when asked for
    error: str | None = None  # set when this group must finish with an error (e.g. NaN logits)
    num_proposed: int = 0  # draft tokens proposed for this group this step (its k; 0 = not speculated)
    num_accepted: int = 0  # of those, accepted by the verifier


@dataclass
class StepOutput:
    outputs: list[GroupStepOutput]  # one per SequenceGroupMetadata, same order
    times: dict[str, float] = field(default_factory=dict)  # seconds spent per phase, e.g. propose/score/verify


class Worker(ABC):
    """Runs one step of an ExecuteModelRequest. Owns the engines and their slots."""

    @abstractmethod
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> StepOutput: ...

    @abstractmethod
    def free_requests(self, request_ids: list[str]) -> None:
        """Release every resource (KV slots, hidden states) held for these requests."""

    @abstractmethod
    def num_free_slots(self) -> int: ...

    @abstractmethod
    def snapshot(self, seq_group_metadata_list: list) -> Any:
        """Called before each step: what :meth:`restore` needs to undo it for these sequences."""

    @abstractmethod
    def restore(self, snapshot: Any) -> None:
        """The step raised (or was interrupted): put every KV length, draft state and hidden state back
        to what :meth:`snapshot` saw, and release what the step allocated, so the step can run again."""
