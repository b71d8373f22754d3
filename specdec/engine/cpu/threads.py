"""How many threads the CPU kernels use: all of them on a quiet machine, fewer while another process wants a core.

Issue #43 item 3. The kernels' OpenMP pool meets ~300 barriers per forward. Two ways to wait there, both measured
on a 2-core Zen 4 (AVX512-BF16, bf16 SmolLM2, one-token forward after 256 tokens, median of 30; LOG 2026-11-29):

| pool | quiet | beside one busy process |
|---|---|---|
| 2 threads, passive wait (block at once) | 19.9 ms | 14.6 ms |
| 2 threads, spin ~10k iterations, then block | 9.8-10.5 ms | 20-26 ms |
| 1 thread | 11.5 ms | 11.7 ms |

Blocking at once costs a wake-up per barrier (the hypervisor halts an idle vCPU: 2x on the quiet forward); spinning
holds a core that the other thread, preempted by the busy process, needs. So the pool spins briefly
(``GOMP_SPINCOUNT``, set in ``specdec/__init__.py``) and this governor takes a thread away while the process is
being preempted, and gives it back once the machine is quiet again:

- with all threads, the signal is involuntary context switches of this process (``getrusage``): 0-1 per quiet
  forward, 2-34 per forward beside one busy process (LOG 2026-11-29); on 2026-12-05 (same kind of box, bf16 one-token
  forwards after 256 tokens, 40 each, the governor off) 26-36 a second quiet and 103-113 a second beside one busy
  process (~2 per 20 ms forward), under the 150 this threshold then was, so the governor never acted
  (`experiments/bench/contention.py`: 2.0-2.5x). ``SWITCH_RATE`` per second over ``BUSY_WINDOWS`` windows in a row of
  at least ``WINDOW_S`` each marks the machine busy: one thread fewer (at least one). A 0.1 s window holds ~10
  forwards, so a quiet window's few stray switches stay well under the rate;
- with fewer, the signal is the count of runnable tasks in ``/proc/loadavg`` (this process's waiting workers
  block, so it counts this thread and other processes): ``QUIET_CHECKS`` readings in a row with room for all
  threads give them back; so does a probe every ``PROBE_S`` seconds (the switch rate decides again).

One pool per process, so one governor per process (:func:`governor`); every native forward calls
:meth:`ThreadGovernor.before` and :meth:`ThreadGovernor.after`. The kernels' results do not depend on the thread
count (threads split outputs, never a reduction; ``kernels.cpp``), so a change is invisible in the tokens.
``SPECDEC_ADAPT_THREADS=0`` turns it off (fixed threads, for benchmarks that want exactly that).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable

import torch

__all__ = ["ThreadGovernor", "governor", "involuntary_switches", "runnable_tasks", "thread_report"]

SWITCH_RATE = 70.0  # involuntary switches per second that mean another process takes our cores (quiet: ~30)
WINDOW_S = 0.1  # judge the switch rate over at least this much forward time
BUSY_WINDOWS = 2  # windows in a row over SWITCH_RATE (one alone was a short task's blip: a subprocess, a kworker)
QUIET_CHECKS = 5  # /proc/loadavg readings in a row with room for every thread before they come back
PROBE_S = 2.0  # with fewer threads, try all of them again this often


def involuntary_switches() -> int:
    """Involuntary context switches of this process so far (every thread): preemptions by other tasks."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def runnable_tasks() -> int | None:
    """Tasks runnable on the machine now (this thread included), from /proc/loadavg; None where unreadable."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


class ThreadGovernor:
    def __init__(
        self,
        cores: int | None = None,
        *,
        enabled: bool | None = None,
        switches: Callable[[], int] = involuntary_switches,
        runnable: Callable[[], int | None] = runnable_tasks,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cores = cores or len(os.sched_getaffinity(0))
        self._switches, self._runnable, self._clock = switches, runnable, clock
        if enabled is None:
            enabled = os.environ.get("SPECDEC_ADAPT_THREADS", "1") != "0"
        self.enabled = enabled
        self.full = torch.get_num_threads()  # what the user or the engine asked for
        self.current = self.full
        self.reduced_forwards = 0  # forwards run with fewer threads than `full` (a busy machine's mark)
        self.forwards = 0
        self._win_t = 0.0
        self._win_sw = 0
        self._quiet = 0
        self._busy = 0
        self._since = 0.0  # when threads were last taken away
        self._t0 = 0.0
        self._sw0 = 0

    def before(self) -> None:
        if not self.enabled:
            return
        n = torch.get_num_threads()
        if n != self.current:  # someone else set the threads (a test, a bench's --threads): that is the new full
            self.full = self.current = n
            self._reset()
        self._t0 = self._clock()
        self._sw0 = self._switches()

    def after(self) -> None:
        if not self.enabled:
            return
        dt = self._clock() - self._t0
        sw = self._switches() - self._sw0
        self.forwards += 1
        if self.current < self.full:
            self.reduced_forwards += 1
        self._win_t += dt
        self._win_sw += sw
        if self._win_t >= WINDOW_S:
            busy = self._win_sw / self._win_t >= SWITCH_RATE
            self._win_t, self._win_sw = 0.0, 0
            self._busy = self._busy + 1 if busy else 0
            if self._busy >= BUSY_WINDOWS and self.current > 1:
                self._set(self.current - 1)
                self._since = self._clock()
                self._quiet = self._busy = 0
                return
        if self.current < self.full:
            r = self._runnable()
            others = None if r is None else r - 1  # this thread is running; fewer threads' workers block
            self._quiet = self._quiet + 1 if others is not None and others + self.full <= self.cores else 0
            if self._quiet >= QUIET_CHECKS or self._clock() - self._since >= PROBE_S:
                self._set(self.full)
                self._reset()

    def _set(self, n: int) -> None:
        self.current = n
        torch.set_num_threads(n)

    def _reset(self) -> None:
        self._win_t, self._win_sw, self._quiet, self._busy = 0.0, 0, 0, 0


_GOVERNOR: ThreadGovernor | None = None


def governor() -> ThreadGovernor:
    """This process's governor (created on first use, with torch's thread count at that moment as `full`)."""
    global _GOVERNOR
    if _GOVERNOR is None:
        _GOVERNOR = ThreadGovernor()
    return _GOVERNOR


def thread_report() -> dict[str, int]:
    """For summaries: the threads asked for, the native forwards so far and how many ran with fewer (a busy box)."""
    g = governor()
    return {"full": g.full, "forwards": g.forwards, "reduced_forwards": g.reduced_forwards}
