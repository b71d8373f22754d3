"""Transactional steps: what a step may change is snapshotted before it and put back if it raises.

A step changes three kinds of state, each restored by :class:`StepSnapshot`:
- the requests: tokens, logprobs, status, stop reason, metrics, seeded generator and grammar matcher
  (GroupCheckpoint);
- the default torch RNG, which unseeded requests draw from;
- the worker: KV lengths and slots, the draft's state, hidden states (``Worker.snapshot/restore``).

A snapshot costs O(batch) per step (a few ints per sequence, one RNG state per seeded request). It knows
nothing about models or how a step is computed; the step loop (llm_engine.py) decides what to re-run.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from specdec.interfaces import Worker
from specdec.datamodel.sequence import RequestMetrics, SequenceGroup


def _copy_metrics(m: RequestMetrics) -> RequestMetrics:
    counts = m.spec_token_acceptance_counts
    return msgspec.structs.replace(m, spec_token_acceptance_counts=None if counts is None else list(counts))


@dataclass
class GroupCheckpoint:
    group: SequenceGroup
    seqs: list[tuple]  # Sequence.checkpoint() of each sequence
    metrics: RequestMetrics  # a copy
    generator_state: torch.Tensor | None  # the request's seeded generator, None when unseeded
    grammar_state: int | None  # GrammarState.checkpoint (tokens its matcher keeps), None without guided_decoding

    @classmethod
    def take(cls, group: SequenceGroup) -> GroupCheckpoint:
        gen, grammar = group.state.generator, group.state.grammar
        return cls(group, [s.checkpoint() for s in group.get_seqs()], _copy_metrics(group.metrics),
                   None if gen is None else gen.get_state(),
                   None if grammar is None else grammar.checkpoint(group.first_seq.get_output_token_ids()))

    def restore(self) -> None:
        for seq, cp in zip(self.group.get_seqs(), self.seqs):
            seq.restore(cp)
        self.group.metrics = _copy_metrics(self.metrics)  # a copy again: a snapshot may be restored twice
        if self.generator_state is not None:
            self.group.state.generator.set_state(self.generator_state)
        if self.grammar_state is not None:
            self.group.state.grammar.restore(self.grammar_state)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class StepSnapshot:
    """Everything one step over ``groups`` may change; :meth:`restore` puts it back (more than once if need be)."""

    def __init__(self, worker: Worker, groups: list[SequenceGroup], metas: list) -> None:
        self.worker = worker
        self.worker_state: Any = worker.snapshot(metas)
        self.groups = [GroupCheckpoint.take(g) for g in groups]
        self.rng = _rng_state()

    def restore(self) -> None:
        self.worker.restore(self.worker_state)
        for cp in self.groups:
            cp.restore()
        _set_rng_state(self.rng)


def step_error(request_id: str, exc: BaseException, isolated: bool) -> str:
    """The error a request finishes with when a step raised: what, where, and what happened to the rest."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    what = f"{type(exc).__name__}: {exc}"
    if len(what) > 300:
        what = what[:300] + "..."
    if isolated:
        rest = ("this request makes the step fail even alone, so it was stopped; the step was rolled back and "
                "the other requests continue unchanged")
    else:
        rest = ("the request(s) that caused it could not be told apart, so this step's requests were stopped; "
                "the step was rolled back and the engine goes on")
    return f"request {request_id}: a step failed{where}: {what}; {rest}"
