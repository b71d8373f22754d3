"""The interfaces of one speculative step (after vLLM v0 spec_decode/interfaces.py), chain and tree alike.

propose -> score -> verify -> commit:
  SpeculativeProposer.get_spec_proposals(req, seq_ids_with_bonus_token_in_last_step) -> SpeculativeProposals
  SpeculativeScorer.score_proposals(req, proposals) -> SpeculativeScores
  SpeculativeVerifier.verify_proposals(scores.logits, proposals, root_token_ids, params, gens) -> Verdict
and the worker contract every step runner (plain or speculative) meets: ExecuteModelRequest -> StepOutput.

**A chain is a tree whose parents are i-1.** Every proposal is a token tree per sequence hanging off its
pending token (the last committed token, which the target has not run yet); a k-token chain has
``parents = [-1, 0, 1, ..., k-2]``. Scorers return the target's view of the root-inclusive layout (row 0 =
the pending token, row i = draft node i-1); verifiers return the accepted root-to-node path. So the worker
has one step for both, and the seed's chain names (``proposal_token_ids`` / ``proposal_probs`` /
``proposal_lens``) are views of a chain proposal.
Implementations live in proposers/, scorers/, specdec/verify/chain.py, specdec/verify/tree.py and
specdec/spec_decode/spec_decode_worker.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from specdec.engine.interface import LogitStats, current_stats
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.sequence import Logprob


@dataclass
class SpeculativeProposals:
    """A token tree per sequence, padded to N nodes (a chain of k drafts: N = k, parents i-1)."""

    token_ids: torch.Tensor  # [B, N] int64 draft token of each node; -1 = padding (i >= num_nodes[b])
    parents: torch.Tensor  # [B, N] int64 parent node, -1 = child of the pending token; < i
    num_nodes: torch.Tensor  # [B] int64 real nodes per row; 0 = no speculation for this row this step
    # [B, N, V] float32: the law node i's token was drawn from, given its earlier siblings (with
    # replacement: the parent's q; without: q minus the earlier siblings, renormalised). None = every
    # node is deterministic (q one-hot at its token: n-gram, greedy drafts, EAGLE-2's top-k trees).
    draft_probs: torch.Tensor | None = None
    # uniforms a seeded random row draws per step when verified as a tree (budget + 1): fixed per run so
    # a seeded row's draws do not depend on the other rows' tree sizes. None = a chain (k draws).
    noise_width: int | None = None
    # the sequences the proposer was handed this step (a row may still get 0 nodes): the feature rows threaded
    # to them (HiddenStates) are spent, and the worker drops them
    drafted_seq_ids: list[int] = field(default_factory=list)
    # (token_ids, parents, num_nodes) as the proposer returned them, before Top1Proposer cut rows to the policy's
    # numbers (cut_proposals); None = nothing was cut. A tree policy learns from the nodes it did not score
    uncut: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        B, N = self.token_ids.shape
        if self.parents.shape != (B, N) or self.num_nodes.shape != (B,):
            raise ValueError(f"SpeculativeProposals: token_ids {tuple(self.token_ids.shape)}, parents "
                             f"{tuple(self.parents.shape)}, num_nodes {tuple(self.num_nodes.shape)}; expected "
                             f"[B, N], [B, N], [B]")
        if self.draft_probs is not None and tuple(self.draft_probs.shape[:2]) != (B, N):
            raise ValueError(f"SpeculativeProposals: draft_probs {tuple(self.draft_probs.shape)}; expected "
                             f"[{B}, {N}, V]")
        if not N:
            return
        if B * N <= 256 and self.parents.device.type == "cpu":  # a step's few nodes: lists beat ~8 tensor ops
            par, tok, nn = self.parents.tolist(), self.token_ids.tolist(), self.num_nodes.tolist()
            bad_at = next(((b, i) for b in range(B) for i in range(min(max(nn[b], 0), N))
                           if not (-1 <= par[b][i] < i and tok[b][i] >= 0)), None)
        else:
            idx = torch.arange(N, device=self.parents.device)
            real = idx[None, :] < self.num_nodes[:, None]
            bad = real & ((self.parents < -1) | (self.parents >= idx[None, :]) | (self.token_ids < 0))
            bad_at = tuple(int(v) for v in bad.nonzero()[0]) if bool(bad.any()) else None
        if bad_at is not None:
            b, i = bad_at
            raise ValueError(f"SpeculativeProposals: row {b} node {i} has parent {int(self.parents[b, i])} and "
                             f"token {int(self.token_ids[b, i])}; a node needs -1 <= parent < its index and a "
                             "token >= 0")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def chain(cls, token_ids: torch.Tensor,  # [B, k] int64, -1 past a row's length
              draft_probs: torch.Tensor | None,  # [B, k, V] or None (one-hot)
              lens: torch.Tensor,  # [B] int64 drafts per row
              ) -> "SpeculativeProposals":
        B, k = token_ids.shape
        parents = (torch.arange(k) - 1).expand(B, k).clone()
        return cls(token_ids, parents, lens, draft_probs)

    @classmethod
    def empty(cls, batch_size: int) -> "SpeculativeProposals":
        z = torch.zeros(batch_size, 0, dtype=torch.long)
        return cls(z, z.clone(), torch.zeros(batch_size, dtype=torch.long))

    def scatter_rows(self, rows: list[int], batch_size: int) -> "SpeculativeProposals":
        """These proposals for rows ``rows`` of a batch of ``batch_size``; the other rows get no nodes."""
        B, N = batch_size, self.token_ids.shape[1]
        idx = torch.tensor(rows, dtype=torch.long)
        tok = torch.full((B, N), -1, dtype=torch.long).index_copy_(0, idx, self.token_ids.cpu())
        par = torch.full((B, N), -1, dtype=torch.long).index_copy_(0, idx, self.parents.cpu())
        n = torch.zeros(B, dtype=torch.long).index_copy_(0, idx, self.num_nodes.cpu())
        q = None
        if self.draft_probs is not None:
            q = self.draft_probs.new_zeros(B, *self.draft_probs.shape[1:]).index_copy_(
                0, idx.to(self.draft_probs.device), self.draft_probs)
        return SpeculativeProposals(tok, par, n, q, self.noise_width, list(self.drafted_seq_ids))

    # ---- views ----------------------------------------------------------------------------------
    @property
    def is_chain(self) -> bool:
        """Every real node's parent is the node before it (the layout chain scorers and verifiers take)."""
        B, N = self.parents.shape
        if B * N <= 256 and self.parents.device.type == "cpu":  # asked twice a step (scorer, verifier): lists,
            par, nn = self.parents.tolist(), self.num_nodes.tolist()  # not ~6 tensor ops on a forward's cold caches
            return all(par[b][i] == i - 1 for b in range(B) for i in range(min(max(nn[b], 0), N)))
        idx = torch.arange(self.token_ids.shape[1], device=self.parents.device)
        real = idx[None, :] < self.num_nodes[:, None]
        return bool(((self.parents == idx - 1) | ~real).all())

    @property
    def no_proposals(self) -> bool:
        return not bool((self.num_nodes > 0).any())

    @property
    def proposal_token_ids(self) -> torch.Tensor:  # [B, k] (seed name, chains)
        return self.token_ids

    @property
    def proposal_probs(self) -> torch.Tensor | None:  # [B, k, V] (seed name, chains)
        return self.draft_probs

    @property
    def proposal_lens(self) -> torch.Tensor:  # [B] (seed name, chains)
        return self.num_nodes

    def with_root(self, root_token_ids: torch.Tensor,  # [B] int64 each sequence's pending token
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # parents [B, N+1], token_ids [B, N+1]
        """The root-inclusive layout of specdec_kernels/tree.py: node 0 = the pending token, draft i = node i+1."""
        B = self.token_ids.shape[0]
        dev = self.token_ids.device
        parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), self.parents + 1], 1)
        tokens = torch.cat([root_token_ids.to(dev, torch.long).reshape(B, 1), self.token_ids], 1)
        return parents, tokens

    def narrowed(self) -> "SpeculativeProposals":
        """These proposals at the width of their longest row (at least 1): the padding past it dropped, so that the
        scores of a batch 1 step need no padded copy of its logits ([k+1, V] rows into [N+1, V]: ~0.4 ms a step of
        n-gram with k chosen below its limit). Random rows draw per the width (chains: N uniforms), so the worker
        narrows only batches that draw nothing (every row greedy)."""
        n = max(max(self.num_nodes.tolist(), default=0), 1)
        if n >= self.token_ids.shape[1]:
            return self
        q = None if self.draft_probs is None else self.draft_probs[:, :n]
        return replace(self, token_ids=self.token_ids[:, :n], parents=self.parents[:, :n], draft_probs=q)

    def draft_probs_with_root(self) -> torch.Tensor | None:  # [B, N+1, V], row 0 (the root) zero
        q = self.draft_probs
        return None if q is None else torch.cat([q.new_zeros(q.shape[0], 1, q.shape[2]), q], 1)


@dataclass
class SpeculativeScores:
    """The target's view of the proposals, root-inclusive: row 0 = the pending token, row i = node i-1
    (a chain of k: k+1 rows, the last one giving the bonus token). Rows past a sequence's nodes repeat
    its last row."""

    logits: torch.Tensor  # [B, N+1, V] float32 raw target logits of the token after each row's token
    hidden_states: torch.Tensor  # [B, N+1, F] the target's features at each row (FeatureSpec's layers)
    # [B, N+1] argmax / logsumexp / finite of each row of ``logits``, when the engine took them as it wrote the
    # logits (specdec.engine.interface.LogitStats); read them through ``current_logit_stats``
    logit_stats: LogitStats | None = None

    def current_logit_stats(self) -> LogitStats | None:
        """``logit_stats`` while they still describe ``logits`` (not replaced or edited since), else None."""
        return current_stats(self.logit_stats, self.logits)

    @property
    def nonfinite_rows(self) -> torch.Tensor:  # [B] bool
        """Sequences whose logits hold a NaN or an inf anywhere: they finish with an error and must not poison
        the others. Read from the engine's stats when it took them (no pass over the logits), else computed
        (NaN/inf propagate through the sum). The logits themselves are never edited."""
        stats = self.current_logit_stats()
        if stats is None:
            return ~torch.isfinite(self.logits.sum(-1)).all(-1)
        return stats.nonfinite_rows()

    @property
    def logprobs(self) -> torch.Tensor:  # [B, N+1, V] log_softmax of the raw logits
        return torch.log_softmax(self.logits, dim=-1)

    @property
    def probs(self) -> torch.Tensor:  # [B, N+1, V]
        return torch.softmax(self.logits, dim=-1)

    @property
    def token_ids(self) -> torch.Tensor:  # [B, N+1] target argmax
        return self.logits.argmax(-1)


@dataclass
class Verdict:
    """What verification decided, root-inclusive, -1 padded."""

    path: torch.Tensor  # [B, N+1] int64 accepted nodes from the root (path[:, 0] = 0, the pending token)
    out: torch.Tensor  # [B, N+1] int64 emitted tokens: the accepted drafts then one target token

    @property
    def num_accepted(self) -> torch.Tensor:  # [B] int64 accepted drafts
        return (self.path >= 0).sum(1) - 1

    @cached_property
    def accepted_paths(self) -> list[list[int]]:  # [B][num_accepted + 1] each row's path, root first, as lists
        """``path`` without its padding, read once (a verdict is not edited after verification): a step's commit,
        logprobs and leaf test walk a few ints each, where tensor ops cost 20-50 us on the caches a forward left."""
        return [[x for x in row if x >= 0] for row in self.path.tolist()]


class SpeculativeProposer(ABC):
    @abstractmethod
    def get_spec_proposals(self, execute_model_req: ExecuteModelRequest,
                           seq_ids_with_bonus_token_in_last_step: set[int]) -> SpeculativeProposals:
        raise NotImplementedError


class SpeculativeScorer(ABC):
    """One target forward over every sequence's [pending token, draft nodes]."""

    drafts_trees: bool = False  # True: the proposer is asked for trees (TreeShape), else for chains

    @abstractmethod
    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        raise NotImplementedError


class SpeculativeVerifier(ABC):
    """Which drafts to keep and the next token, from the target's raw logits and each row's params."""

    verifies_trees: bool = False  # True: also verifies branching proposals (scorers with drafts_trees)
    # True: verify_proposals takes ``target_argmax`` ([B, N+1] int64, the rows' argmax when the engine took it
    # with the logits: SpeculativeScores.logit_stats), so greedy rows need not read the logits again. A subclass
    # of a verifier that says True and overrides verify_proposals must take it too, or set this to False.
    takes_target_argmax: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "SpeculativeVerifier":
        """Built from a SpeculativeConfig (its ``kernel``, and whatever keys the verifier reads)."""
        return cls(kernel=config.kernel)

    @abstractmethod
    def verify_proposals(self, target_logits: torch.Tensor,  # [B, N+1, V] float32 raw, root-inclusive
                         proposals: SpeculativeProposals,
                         root_token_ids: torch.Tensor,  # [B] int64 each sequence's pending token
                         params: Sequence[Any],  # [B] SamplingParams
                         generators: Sequence[torch.Generator | None],  # [B]
                         ) -> Verdict: ...


@dataclass
class GroupStepOutput:
    """What one step produced for one sequence group."""

    token_ids: list[int]  # emitted tokens, 1..k+1 (empty when the step failed for this group)
    logprobs: list[dict[int, Logprob]] | None = None  # per emitted token, when asked for
    error: str | None = None  # set when this group must finish with an error (e.g. NaN logits)
    num_proposed: int = 0  # draft tokens (tree nodes) proposed for this group this step (0 = not speculated)
    num_accepted: int = 0  # of those, accepted by the verifier (a tree: the accepted path's length)
    num_chosen: int = 0  # the speculation policy's k (a tree: node budget) for this group this step (policy.py)


@dataclass
class StepOutput:
    outputs: list[GroupStepOutput]  # one per SequenceGroupMetadata, same order
    times: dict[str, float] = field(default_factory=dict)  # seconds spent per phase, e.g. propose/score/verify


class Worker(ABC):
    """Runs one step of an ExecuteModelRequest. Owns the engines and their slots."""

    speculative: bool = False  # True: steps draft and verify (the step loop reserves lookahead slots)

    def release(self) -> None:
        """The step loop went idle: hand back what the engines hold between steps. Default: nothing."""

    @abstractmethod
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> StepOutput: ...

    def decode_steps(self, metas: list, num_steps: int, limits: list,
                     ) -> tuple[list[list[GroupStepOutput]], dict[str, float]] | None:
        """Multi-step decoding's fast loop (specdec/core/multi_step.py; PlainWorker has one): up to ``num_steps``
        decode steps of these rows, limits [B] (budget, stop ids) per row. Default None: the step loop runs
        ``execute_model`` once per step instead."""
        return None

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
