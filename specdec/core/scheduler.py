"""FCFS continuous batching: admits waiting requests up to max_num_seqs, frees finished ones at once.

The scheduler knows nothing about models, KV caches or speculation: it moves SequenceGroups between a
waiting queue and a running list and tells the engine loop which step to run next.

Every operation costs O(batch), whatever the queue length: an abort finds its group through a dict; a
group aborted while waiting stays in the deque, marked finished, and is dropped when it reaches the front
(``num_waiting`` counts only the live ones).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specdec.datamodel.sequence import SequenceGroup, SequenceStatus
from specdec.core.validate import check_int


@dataclass
class SchedulerOutputs:
    scheduled: list[SequenceGroup]  # the groups to run this step, all prefills or all decodes
    is_prompt: bool  # True: a prefill step for newly admitted groups
    num_waiting: int  # requests still queued after this decision (ExecuteModelRequest.num_waiting)


class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = check_int("Scheduler", "max_num_seqs", max_num_seqs, 1)
        self.waiting: deque[SequenceGroup] = deque()  # FCFS; may hold groups aborted while waiting
        self.running: list[SequenceGroup] = []
        self.num_waiting = 0  # live (not aborted) groups in `waiting`
        self._unfinished: dict[str, SequenceGroup] = {}  # request id -> group, waiting or running

    def add_seq_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)
        self.num_waiting += 1
        self._unfinished[group.request_id] = group

    def has_unfinished(self) -> bool:
        return bool(self.num_waiting or self.running)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Mark a waiting or running request aborted and drop it. Returns it, or None if unknown."""
        group = self._unfinished.pop(request_id, None)
        if group is None:
            return None
        if any(g is group for g in self.running):
            self.running = [g for g in self.running if g is not group]
        else:
            self.num_waiting -= 1  # left in the deque; schedule() skips it
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_ABORTED
        group.set_finished_time(time.time())
        return group

    def schedule(self) -> SchedulerOutputs:
        """Prefill newly admitted groups first (vLLM v0 order); otherwise decode all running ones."""
        admitted: list[SequenceGroup] = []
        now = time.time()
        while self.num_waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            group = self.waiting.popleft()
            if group.is_finished():  # aborted while waiting
                continue
            self.num_waiting -= 1
            for seq in group.get_seqs():
                seq.status = SequenceStatus.RUNNING
            group.maybe_set_first_scheduled_time(now)
            admitted.append(group)
        if admitted:
            self.running.extend(admitted)
            return SchedulerOutputs(admitted, True, self.num_waiting)
        return SchedulerOutputs(list(self.running), False, self.num_waiting)

    def requeue(self, groups: list[SequenceGroup]) -> None:
        """Undo the admission of ``groups`` (a prefill that was rolled back): back to the queue's front,
        in their order."""
        ids = {id(g) for g in groups}
        self.running = [g for g in self.running if id(g) not in ids]
        for group in reversed(groups):
            for seq in group.get_seqs():
                seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(group)
            self.num_waiting += 1

    def free_finished(self) -> list[SequenceGroup]:
        """Drop finished groups from the running list and return them."""
        done = [g for g in self.running if g.is_finished()]
        if done:
            self.running = [g for g in self.running if not g.is_finished()]
            for g in done:
                self._unfinished.pop(g.request_id, None)
        return done
