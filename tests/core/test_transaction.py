"""specdec/core/transaction.py: a snapshot taken before a step and restored after it puts back exactly
what the step changed: tokens, logprobs, status, stop reason, metrics, a seeded request's generator, the
default RNG and (through Worker.snapshot/restore) the worker's state. step_error words the failure."""

from __future__ import annotations

import msgspec
import pytest
import torch

from specdec.core.transaction import GroupCheckpoint, StepSnapshot, step_error
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from specdec.interfaces import StepOutput, Worker


def seeded_group(seed: int | None = 7) -> SequenceGroup:
    g = SequenceGroup("r", [Sequence(0, [4, 5, 6])], arrival_time=1.0,
                      sampling_params=SamplingParams(seed=seed), draft_size=3)
    if seed is not None:
        g.state.generator = torch.Generator().manual_seed(seed)
    g.first_seq.status = SequenceStatus.RUNNING
    g.first_seq.append_token_id(9, {9: Logprob(logprob=-0.5)})  # one token before the step
    return g


def state_of(g: SequenceGroup) -> tuple:
    seq = g.first_seq
    return (seq.get_token_ids(), seq.get_cumulative_logprob(), list(seq.output_logprobs), seq.status,
            seq.stop_reason, msgspec.to_builtins(g.metrics))


def run_a_step(g: SequenceGroup) -> None:
    """What a step does to a request: draws (from its generator, or the default one when unseeded), appends
    tokens, finishes it, counts."""
    torch.rand(3, generator=g.state.generator)  # generator=None: the default generator
    seq = g.first_seq
    seq.append_token_id(11, {11: Logprob(logprob=-1.25)})
    seq.append_token_id(12, {12: Logprob(logprob=-2.0)})
    seq.status = SequenceStatus.FINISHED_STOPPED
    seq.stop_reason = 12
    g.metrics.first_token_time = 2.0
    g.metrics.spec_token_acceptance_counts[0] += 1  # in place, as llm_engine._append does
    g.metrics.spec_token_acceptance_counts[1] += 1


def test_group_checkpoint_restores_tokens_status_metrics_and_generator_exactly():
    g = seeded_group()
    torch.rand(5, generator=g.state.generator)  # the generator has been used before the step
    before = state_of(g)
    cp = GroupCheckpoint.take(g)
    run_a_step(g)
    assert state_of(g) != before  # the step changed something, or the test below proves nothing
    cp.restore()
    assert state_of(g) == before

    # drawn after the restore, the generator gives what one never advanced by the step gives
    ref = torch.Generator().manual_seed(7)
    torch.rand(5, generator=ref)
    assert torch.equal(torch.rand(8, generator=g.state.generator), torch.rand(8, generator=ref))


def test_a_checkpoint_can_be_restored_twice():
    """The engine restores a probe's snapshot and may restore it again: the restored metrics must not
    alias the checkpoint's copy, or the second step's in-place counts would leak into it."""
    g = seeded_group()
    before = state_of(g)
    cp = GroupCheckpoint.take(g)
    for _ in range(2):
        run_a_step(g)
        cp.restore()
        assert state_of(g) == before


def test_unseeded_group_has_no_generator_state():
    g = seeded_group(seed=None)
    cp = GroupCheckpoint.take(g)
    assert cp.generator_state is None
    g.first_seq.append_token_id(11, {})
    cp.restore()
    assert g.first_seq.get_output_token_ids() == [9]


class RecordingWorker(Worker):
    """Its state is one int that a step bumps; snapshot/restore save and put it back."""

    def __init__(self) -> None:
        self.state = 0
        self.snapshots_of: list[list] = []

    def execute_model(self, execute_model_req) -> StepOutput:
        raise NotImplementedError

    def free_requests(self, request_ids) -> None:
        pass

    def num_free_slots(self) -> int:
        return 1

    def snapshot(self, seq_group_metadata_list):
        self.snapshots_of.append(seq_group_metadata_list)
        return self.state

    def restore(self, snapshot) -> None:
        self.state = snapshot


def test_step_snapshot_restores_worker_groups_and_default_rng():
    worker = RecordingWorker()
    worker.state = 3
    groups = [seeded_group(7), seeded_group(None)]
    before = [state_of(g) for g in groups]
    metas = ["meta-a", "meta-b"]  # opaque to the snapshot: handed to the worker as they are
    torch.manual_seed(123)
    snap = StepSnapshot(worker, groups, metas)
    assert worker.snapshots_of == [metas]

    worker.state = 4
    for g in groups:
        run_a_step(g)  # the unseeded one draws from the default generator

    snap.restore()
    assert worker.state == 3
    assert [state_of(g) for g in groups] == before
    torch.manual_seed(123)
    want = torch.rand(4)
    snap.restore()  # again: the default RNG goes back to where the snapshot saw it
    assert torch.equal(torch.rand(4), want)


def raise_here():
    raise KeyError("bad slot")


def test_step_error_names_the_exception_its_place_and_what_happened_to_the_rest():
    with pytest.raises(KeyError) as info:
        raise_here()
    alone = step_error("r7", info.value, isolated=True)
    assert alone.startswith("request r7: a step failed in test_transaction.py:")
    assert "(raise_here)" in alone and "KeyError: 'bad slot'" in alone
    assert "other requests continue unchanged" in alone
    together = step_error("r7", info.value, isolated=False)
    assert "could not be told apart" in together and "other requests continue" not in together


def test_step_error_cuts_long_messages_and_handles_no_traceback():
    msg = step_error("r", RuntimeError("x" * 1000), isolated=True)  # never raised: no traceback
    assert "a step failed: RuntimeError: " in msg
    assert "x" * 300 not in msg and "..." in msg
