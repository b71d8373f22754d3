"""FeatureStore: the worker's threaded target features, kept per sequence until its proposer reads them.

Every forward's rows join their sequence's chunks (:meth:`extend`); a speculative step builds the one
:class:`HiddenStates` its proposer reads from the batch's sequences only (:meth:`select`), and the rows a proposer
read are dropped (:meth:`discard`). A sequence that does not draft for a while (a plain step, a policy at 0) keeps
gathering rows, so the cost of a step must not grow with what the other sequences hold: one ``HiddenStates`` for
all of them re-gathered every held row at each ``extend`` (a cat and an index of [all rows, F] per step), 3.9 ms of
a 60 ms plain step of eagle3_ngram at B = 11 on 128-token requests, O(tokens^2) over a long generation. Here a step
costs O(its own rows): a list append per sequence, and one cat per sequence when its rows are read.

Chunks are never modified in place, so :meth:`copy` (a transaction's snapshot) shares them. Knows nothing about
proposers or models.
"""

from __future__ import annotations

import torch

from specdec.datamodel.hidden_states import HiddenStates


class FeatureStore:
    """Per sequence, its feature rows [m, F] in token order, as a list of chunks."""

    def __init__(self, chunks: dict[int, list[torch.Tensor]] | None = None) -> None:
        self.chunks: dict[int, list[torch.Tensor]] = chunks if chunks is not None else {}
        self.dtype: torch.dtype | None = None  # the first rows' dtype: every later row is stored in it

    def extend(self, feats: torch.Tensor,  # [R, F] new rows, each sequence's contiguous and in token order
               owners: list[int],  # [R] the owner of each row
               history: int | None = None) -> None:
        """Append each sequence's new rows after its held ones, keeping its last ``history`` (None: all)."""
        if feats.shape[0] != len(owners):
            raise ValueError(f"FeatureStore.extend: {feats.shape[0]} rows for {len(owners)} owners")
        if self.dtype is None:
            self.dtype = feats.dtype
        feats = feats.to(self.dtype)
        start = 0
        for i in range(1, len(owners) + 1):  # runs of one owner: a copy each (no view pins the step's tensor)
            if i == len(owners) or owners[i] != owners[start]:
                s = owners[start]
                held = self.chunks.setdefault(s, [])
                held.append(feats[start:i].clone())
                if history is not None and sum(c.shape[0] for c in held) > history:
                    self.chunks[s] = [torch.cat(held)[-history:].clone()] if history > 0 else []
                start = i

    def discard(self, seq_ids: set[int]) -> None:
        """Drop these sequences' rows (read, finished or aborted); unknown ids are ignored."""
        for s in seq_ids:
            self.chunks.pop(s, None)

    def held(self) -> set[int]:
        """The sequences with rows."""
        return {s for s, c in self.chunks.items() if c}

    def rows(self, seq_id: int) -> torch.Tensor | None:
        """[m, F] the sequence's rows in one tensor (consolidated in place: read again, no second cat), None if none."""
        held = self.chunks.get(seq_id)
        if not held:
            return None
        if len(held) > 1:
            self.chunks[seq_id] = held = [torch.cat(held)]
        return held[0]

    def select(self, seq_ids: list[int] | set[int]) -> HiddenStates:
        """A HiddenStates of these sequences' rows (sequences with none are left out), the store unchanged."""
        parts, owners = [], []
        for s in seq_ids:
            r = self.rows(s)
            if r is not None:
                parts.append(r)
                owners += [s] * r.shape[0]
        if not parts:
            width = next((c[0].shape[1] for c in self.chunks.values() if c), 0)
            return HiddenStates(torch.empty(0, width, dtype=self.dtype or torch.float32), None, None, [])
        return HiddenStates(torch.cat(parts) if len(parts) > 1 else parts[0], None, None, owners)

    def copy(self) -> FeatureStore:
        """A new store sharing the chunks (never modified in place) with its own lists."""
        out = FeatureStore({s: list(c) for s, c in self.chunks.items()})
        out.dtype = self.dtype
        return out

    # inspection (tests, debugging): every held row, sequences in the order they arrived
    @property
    def seq_ids(self) -> list[int]:
        """[rows] the owner of each held row."""
        return [s for s, c in self.chunks.items() for t in c for _ in range(t.shape[0])]

    @property
    def hidden_states(self) -> torch.Tensor:
        """[rows, F] every held row."""
        return self.select(list(self.chunks)).hidden_states
