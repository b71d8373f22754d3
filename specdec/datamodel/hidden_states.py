"""The tensor-carrying half of the data model (after ``vllm.sequence``): what flows to the proposers.

- ``HiddenStates``: the target's features, rows owned by sequences, threaded from one step to the next
  for proposers that read them (EAGLE, Medusa, MLP speculator; see ``FeatureSpec``).
- ``ExecuteModelRequest``: one step's batch, including the ``HiddenStates`` of the previous step.

These are msgspec Structs for symmetry with the seed, but tensors never go on the wire (the encode
helpers of :mod:`specdec.vllm_compat` refuse them). Only what the step calls lives here; the seed's
``HiddenStates.update/prune/expand_with_bonus_tokens`` and ``ExecuteModelRequest``'s multi-step
properties and ``clone`` are functions of :mod:`specdec.vllm_compat`. Imports
:mod:`specdec.datamodel.metadata` only. Knows nothing about models, sampling or KV caches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import msgspec
import torch

from specdec.datamodel.metadata import (
    SequenceGroupMetadata,
    SequenceGroupMetadataDelta,
    get_all_seq_ids,
)


class HiddenStates(msgspec.Struct, array_like=True, omit_defaults=True):
    """The target's hidden states for in-flight sequences: row i belongs to sequence ``seq_ids[i]``.

    The step threads rows with :meth:`extend` (a sequence's latest ``history`` rows, in token order),
    :meth:`select` and :meth:`discard`. The seed's ``update``/``prune``/``expand_with_bonus_tokens`` are
    functions of :mod:`specdec.vllm_compat` (they use :meth:`_take` and :meth:`_require_seq_ids`).
    """

    # [num_rows, hidden_size] after a prefill or plain step: the last token of each sequence; after
    # verification: the last accepted position.
    hidden_states: torch.Tensor
    # The metadata the rows were built from (gives the seq ids at construction). Set to None once the
    # rows change: read `seq_ids` instead.
    seq_group_metadata_list: list[SequenceGroupMetadata] | None = None
    # [num_rows, hidden_size] the state one position before `hidden_states` (the 2nd-last token the
    # proposer proposed, accepted or not); the seed's bonus-token bookkeeping (vllm_compat), None in the step.
    second_last_token_hidden_states: torch.Tensor | None = None
    # [num_rows] the sequence owning each row. Derived from seq_group_metadata_list when not given.
    _seq_ids: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self._seq_ids and self.seq_group_metadata_list is not None:
            self._seq_ids = get_all_seq_ids(self.seq_group_metadata_list)
        rows = self.hidden_states.shape[0]
        if (self._seq_ids or self.seq_group_metadata_list is not None) and len(self._seq_ids) != rows:
            raise ValueError(f"HiddenStates: hidden_states has {rows} rows but there are "
                             f"{len(self._seq_ids)} sequences; pass one row per sequence.")
        second = self.second_last_token_hidden_states
        if second is not None and second.shape[0] != rows:
            raise ValueError(f"HiddenStates: second_last_token_hidden_states has {second.shape[0]} "
                             f"rows but hidden_states has {rows}; they must match row for row.")

    @property
    def seq_ids(self) -> list[int]:
        """The owner of each row, in row order (a copy)."""
        return list(self._seq_ids)

    def _require_seq_ids(self, op: str) -> None:
        rows = self.hidden_states.shape[0]
        if len(self._seq_ids) != rows:
            raise ValueError(f"HiddenStates.{op}: {rows} rows but {len(self._seq_ids)} known seq ids; "
                             "build it with seq_group_metadata_list (or seq ids) to change its rows.")

    def _take(self, index: list[int]) -> None:
        """Keep rows ``index`` (in that order) of both tensors."""
        rows = torch.tensor(index, dtype=torch.long, device=self.hidden_states.device)
        self.hidden_states = self.hidden_states[rows]
        if self.second_last_token_hidden_states is not None:
            self.second_last_token_hidden_states = self.second_last_token_hidden_states[rows]
        self._seq_ids = [self._seq_ids[i] for i in index]
        self.seq_group_metadata_list = None

    def discard(self, seq_ids: set[int]) -> None:
        """Drop the rows of these sequences (finished or aborted); unknown ids are ignored."""
        if seq_ids & set(self._seq_ids):
            self._require_seq_ids("discard")
            self._take([i for i, s in enumerate(self._seq_ids) if s not in seq_ids])

    def extend(self, hidden_states: torch.Tensor,  # [R, F] new rows, each sequence's in token order
               seq_ids: list[int],  # [R] the owner of each new row
               history: int | None = None) -> None:
        """Append rows after each sequence's existing ones, keeping its last ``history`` (None: all).

        The worker threads every committed token's state this way (a prefill: the prompt's rows; a
        speculative step: the pending token's and the accepted drafts'), so a sequence's rows are the
        states of its latest tokens in order, whatever steps ran since its proposer last read them; the
        seed's one row + second-last row after a bonus token is the case ``history=2``."""
        if hidden_states.shape[0] != len(seq_ids):
            raise ValueError(f"HiddenStates.extend: {hidden_states.shape[0]} rows for {len(seq_ids)} seq ids")
        self._require_seq_ids("extend")
        if self.second_last_token_hidden_states is not None:
            raise ValueError("HiddenStates.extend: rows with second_last_token_hidden_states cannot grow; "
                             "vllm_compat.expand_with_bonus_tokens first")
        owners = self._seq_ids + list(seq_ids)
        rows_of: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(owners):
            rows_of[s].append(i)
        index = [i for rows in rows_of.values() for i in (rows if history is None else rows[-history:])]
        self.hidden_states = torch.cat([self.hidden_states, hidden_states.to(self.hidden_states.dtype)])
        self._seq_ids = owners
        self._take(index)

    def select(self, seq_ids: list[int] | set[int]) -> HiddenStates:
        """A new struct with only these sequences' rows (in the order held; unknown ids are ignored): one
        gather, this struct unchanged. What the worker threads into a step for the batch's sequences."""
        want = set(seq_ids)
        if set(self._seq_ids) <= want:
            return self.copy()
        self._require_seq_ids("select")
        out = self.copy()
        out._take([i for i, s in enumerate(self._seq_ids) if s in want])
        return out

    def copy(self) -> HiddenStates:
        """A new struct sharing the tensors (never modified in place) with its own row bookkeeping."""
        return HiddenStates(self.hidden_states, self.seq_group_metadata_list,
                            self.second_last_token_hidden_states, list(self._seq_ids))


class ExecuteModelRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's batch for the worker: metadata of each request plus the step's settings. The swap and
    multi-step fields are the seed's (read by :mod:`specdec.vllm_compat`; the step leaves them default)."""

    seq_group_metadata_list: list[SequenceGroupMetadata | SequenceGroupMetadataDelta]
    blocks_to_swap_in: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (cpu, device)
    blocks_to_swap_out: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (src, dst)
    virtual_engine: int = 0  # pipeline-parallel engine index (always 0 here)
    num_lookahead_slots: int = 0  # KV slots reserved past the last token: k when speculating
    running_queue_size: int = 0  # requests running; speculation is off at >= disable_by_batch_size
    previous_hidden_states: HiddenStates | None = None  # the target's states from the last step
    num_steps: int = 1  # forward steps for this batch (multi-step decoding)
    spec_step_idx: int | None = None  # which of the k draft steps is running (multi-step proposers)
    finished_requests_ids: list[str] = msgspec.field(default_factory=list)  # since the last step
    last_sampled_token_ids: torch.Tensor | None = None  # [num_seqs, 1] int64, multi-step decoding
    async_callback: Callable | None = None  # called when the step's outputs are ready
    num_waiting: int = 0  # requests queued behind this batch (the speculation policies read it)
