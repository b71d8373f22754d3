"""specdec/core/scheduler.py: FCFS admission up to max_num_seqs, prefills before decodes, finished groups
freed at once, live waiting/running counts, aborts of waiting and running requests, the capacity edge.

Pure bookkeeping: no model. Groups are built by hand; their prompts do not matter to the scheduler."""

from __future__ import annotations

import pytest

from specdec.core.scheduler import Scheduler
from specdec.datamodel.sampling_params import SamplingParams
from specdec.datamodel.sequence import Sequence, SequenceGroup, SequenceStatus


def group(i: int) -> SequenceGroup:
    return SequenceGroup(f"r{i}", [Sequence(i, [1, 2, 3])], arrival_time=0.0, sampling_params=SamplingParams())


def ids(groups) -> list[str]:
    return [g.request_id for g in groups]


def finish(g: SequenceGroup) -> None:
    """What the step loop does when a request emits its last token."""
    for s in g.get_seqs():
        s.status = SequenceStatus.FINISHED_LENGTH_CAPPED


def test_fcfs_admission_up_to_max_num_seqs_then_decodes():
    s = Scheduler(max_num_seqs=2)
    groups = [group(i) for i in range(5)]
    for g in groups:
        s.add_seq_group(g)
    assert s.num_waiting == 5 and s.has_unfinished()

    out = s.schedule()
    assert out.is_prompt and ids(out.scheduled) == ["r0", "r1"]  # arrival order, capped at 2
    assert out.num_waiting == 3 == s.num_waiting
    assert ids(s.running) == ["r0", "r1"]
    assert all(g.first_seq.status == SequenceStatus.RUNNING for g in groups[:2])
    assert all(g.first_seq.status == SequenceStatus.WAITING for g in groups[2:])
    assert groups[0].metrics.first_scheduled_time is not None and groups[2].metrics.first_scheduled_time is None

    out = s.schedule()  # full: no admission, a decode step over the running ones
    assert not out.is_prompt and ids(out.scheduled) == ["r0", "r1"] and out.num_waiting == 3


def test_finished_groups_are_freed_at_once_and_their_places_refilled_in_order():
    s = Scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_seq_group(group(i))
    first = s.schedule().scheduled
    finish(first[1])
    assert ids(s.free_finished()) == ["r1"]
    assert ids(s.running) == ["r0"]
    assert s.free_finished() == []  # handed back once

    out = s.schedule()  # one place free: the next in line is prefilled, alone (prefills first)
    assert out.is_prompt and ids(out.scheduled) == ["r2"] and out.num_waiting == 1
    out = s.schedule()
    assert not out.is_prompt and ids(out.scheduled) == ["r0", "r2"]


def test_capacity_edge_exactly_full_admits_nothing_one_free_admits_one():
    s = Scheduler(max_num_seqs=3)
    for i in range(3):
        s.add_seq_group(group(i))
    assert ids(s.schedule().scheduled) == ["r0", "r1", "r2"]  # exactly max_num_seqs: all three
    s.add_seq_group(group(3))
    out = s.schedule()
    assert not out.is_prompt and len(out.scheduled) == 3 and s.num_waiting == 1  # full: r3 waits
    finish(s.running[0])
    s.free_finished()
    out = s.schedule()
    assert out.is_prompt and ids(out.scheduled) == ["r3"] and len(s.running) == 3


@pytest.mark.parametrize("bad,err", [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_max_num_seqs_is_checked(bad, err):
    with pytest.raises(err, match="Scheduler: max_num_seqs"):
        Scheduler(max_num_seqs=bad)


def test_abort_waiting_request_is_skipped_and_not_counted():
    s = Scheduler(max_num_seqs=1)
    groups = [group(i) for i in range(3)]
    for g in groups:
        s.add_seq_group(g)
    s.schedule()  # r0 runs; r1, r2 wait
    aborted = s.abort_seq_group("r1")
    assert aborted is groups[1] and groups[1].first_seq.status == SequenceStatus.FINISHED_ABORTED
    assert groups[1].metrics.finished_time is not None
    assert s.num_waiting == 1
    assert s.abort_seq_group("r1") is None  # already gone
    finish(groups[0])
    s.free_finished()
    out = s.schedule()
    assert ids(out.scheduled) == ["r2"] and out.num_waiting == 0  # r1 never runs
    assert groups[1].first_seq.status == SequenceStatus.FINISHED_ABORTED


def test_abort_running_request_leaves_the_batch_at_once():
    s = Scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_seq_group(group(i))
    r0 = s.schedule().scheduled[0]
    assert s.abort_seq_group("r0") is r0 and r0.first_seq.status == SequenceStatus.FINISHED_ABORTED
    assert ids(s.running) == ["r1"] and s.num_waiting == 1
    assert s.free_finished() == []  # an aborted group is not "finished" again: nobody is handed it twice
    out = s.schedule()  # its place goes to the next in line
    assert out.is_prompt and ids(out.scheduled) == ["r2"]
    assert ids(s.running) == ["r1", "r2"]


def test_abort_unknown_or_finished_request_returns_none():
    s = Scheduler(max_num_seqs=1)
    s.add_seq_group(g := group(0))
    s.schedule()
    finish(g)
    s.free_finished()
    assert s.abort_seq_group("r0") is None  # finished and freed: nothing to abort
    assert g.first_seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED  # not rewritten to ABORTED
    assert s.abort_seq_group("nobody") is None


def test_unfinished_counts_only_live_requests():
    s = Scheduler(max_num_seqs=1)
    assert not s.has_unfinished()
    s.add_seq_group(group(0))
    s.abort_seq_group("r0")  # aborted while waiting: still in the deque, but not unfinished
    assert not s.has_unfinished() and s.num_waiting == 0
    out = s.schedule()
    assert out.scheduled == [] and not out.is_prompt


def test_requeue_puts_rolled_back_admissions_back_at_the_front_in_order():
    s = Scheduler(max_num_seqs=2)
    groups = [group(i) for i in range(3)]
    for g in groups:
        s.add_seq_group(g)
    admitted = s.schedule().scheduled
    s.requeue(admitted)  # the prefill of r0, r1 was rolled back (e.g. Ctrl-C)
    assert s.running == [] and s.num_waiting == 3
    assert all(g.first_seq.status == SequenceStatus.WAITING for g in admitted)
    assert ids(s.schedule().scheduled) == ["r0", "r1"]  # not overtaken by r2
    assert s.abort_seq_group("r0") is groups[0]  # still known to abort after the requeue
