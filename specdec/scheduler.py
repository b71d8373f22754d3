"""FCFS continuous batching: admits waiting requests up to max_num_seqs, frees finished ones at once.

The scheduler knows nothing about models, KV caches or speculation: it moves SequenceGroups between a
waiting queue and a running list and tells the engine loop which step to run next.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specdec.sequence import SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutputs:
    scheduled: list[SequenceGroup]  # the groups to run this step, all prefills or all decodes
    is_prompt: bool  # True: a prefill step for newly admitted groups
    num_waiting: int  # requests still queued after this decision (vLLM's running_queue_size input)


class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []

    def add_seq_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Mark a waiting or running request aborted and drop it. Returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.get_seqs():
                        if not seq.is_finished():
                            seq.status = SequenceStatus.FINISHED_ABORTED
                    group.set_finished_time(time.time())
                    return group
        return None

    def schedule(self) -> SchedulerOutputs:
        """Prefill newly admitted groups first (vLLM v0 order); otherwise decode all running ones."""
        admitted: list[SequenceGroup] = []
        now = time.time()
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            group = self.waiting.popleft()
            for seq in group.get_seqs():
                seq.status = SequenceStatus.RUNNING
            group.maybe_set_first_scheduled_time(now)
            admitted.append(group)
        if admitted:
            self.running.extend(admitted)
            return SchedulerOutputs(admitted, True, len(self.waiting))
        return SchedulerOutputs(list(self.running), False, len(self.waiting))

    def free_finished(self) -> list[SequenceGroup]:
        """Drop finished groups from the running list and return them."""
        done = [g for g in self.running if g.is_finished()]
        if done:
            self.running = [g for g in self.running if not g.is_finished()]
        return done
