"""The thread governor (engine/cpu/threads.py): one thread fewer while other processes preempt ours, all of them
back when the machine is quiet; with fake signals (the real ones are measured in experiments/bench/contention.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.cpu import threads as T


class Box:
    """A fake machine: a clock, this process's involuntary switches, the runnable tasks."""

    def __init__(self) -> None:
        self.t, self.sw, self.run = 0.0, 0, 1

    def forward(self, gov: T.ThreadGovernor, ms: float, switches: int) -> None:
        gov.before()
        self.t += ms / 1e3
        self.sw += switches
        gov.after()


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def _gov(box: Box, **kw) -> T.ThreadGovernor:
    return T.ThreadGovernor(cores=2, enabled=True, switches=lambda: box.sw, runnable=lambda: box.run,
                            clock=lambda: box.t, **kw)


def test_a_quiet_machine_keeps_every_thread(two_threads):
    box = Box()
    gov = _gov(box)
    for i in range(200):
        box.forward(gov, 10.0, 1 if i % 7 == 0 else 0)  # a stray preemption now and then
        if i == 100:
            box.forward(gov, 35.0, 12)  # a short task's blip (a subprocess): one busy window, not two
    assert gov.current == 2 and torch.get_num_threads() == 2 and gov.reduced_forwards == 0


def test_a_busy_machine_takes_a_thread_and_a_quiet_one_gives_it_back(two_threads):
    box = Box()
    gov = _gov(box)
    box.run = 3
    for _ in range(12):
        box.forward(gov, 20.0, 2)  # beside a busy process: ~2 involuntary switches per 20 ms forward (~100 a second)
    assert gov.current == 1 and torch.get_num_threads() == 1
    for _ in range(20):
        box.forward(gov, 11.0, 0)  # one thread has its core; the other process is still runnable
    assert gov.current == 1 and gov.reduced_forwards >= 20
    box.run = 1  # the other process has gone
    for _ in range(T.QUIET_CHECKS):
        box.forward(gov, 11.0, 0)
    assert gov.current == 2 and torch.get_num_threads() == 2


def test_a_probe_retries_every_thread_and_the_switches_decide_again(two_threads):
    box = Box()
    gov = _gov(box)
    box.run = 5  # unreadable as quiet: only the probe brings the threads back
    for _ in range(12):
        box.forward(gov, 20.0, 10)
    assert gov.current == 1
    n = int(T.PROBE_S / 0.011) + 2
    for _ in range(n):
        box.forward(gov, 11.0, 0)
    assert gov.current == 2  # the probe
    for _ in range(12):
        box.forward(gov, 20.0, 10)
    assert gov.current == 1  # still busy: down again


def test_threads_set_elsewhere_become_the_new_full(two_threads):
    box = Box()
    gov = _gov(box)
    box.forward(gov, 10.0, 0)
    torch.set_num_threads(1)  # a test's one_thread fixture, a bench's --threads
    box.forward(gov, 10.0, 0)
    assert gov.full == 1 and gov.current == 1
    for _ in range(10):
        box.forward(gov, 20.0, 10)
    assert torch.get_num_threads() == 1  # never below one


def test_disabled_governor_never_touches_the_threads(two_threads):
    box = Box()
    gov = _gov(box)
    gov.enabled = False
    for _ in range(10):
        box.forward(gov, 20.0, 10)
    assert torch.get_num_threads() == 2


def test_the_real_signals_are_readable():
    assert T.involuntary_switches() >= 0
    r = T.runnable_tasks()
    assert r is None or r >= 1


def _same_bits_at(counts: tuple[int, ...], forward) -> None:
    """``forward()`` -> (tensors) run at each thread count in ``counts``: every result the same bits as the first."""
    n = torch.get_num_threads()
    outs = []
    try:
        for t in counts:
            torch.set_num_threads(t)
            outs.append(forward())
    finally:
        torch.set_num_threads(n)
    for other in outs[1:]:
        for x, y in zip(outs[0], other):
            assert torch.equal(x, y)


def _tiny(dtype, slots: int):
    from specdec.engine.cpu import ops
    from specdec.engine.tiny import tiny_random_llama

    if ops.lib() is None:
        pytest.skip("native kernels unavailable")
    return tiny_random_llama(0, num_slots=slots, max_model_len=64, dtype=dtype)


def _facts(out) -> tuple:
    return out.logits, out.hidden_states, out.logit_stats.argmax, out.logit_stats.lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_forward_is_bit_identical_at_every_thread_count(dtype):
    """What lets the governor change the threads mid-run: a tree forward's logits, hidden states and LM-head statistics
    are the same bits with 1, 2 or 3 threads (outputs split across threads, never a reduction)."""
    from specdec.engine.interface import ForwardBatch

    eng = _tiny(dtype, 2)
    g = torch.Generator().manual_seed(1)
    a, b = eng.allocate_slot(), eng.allocate_slot()
    eng.forward(ForwardBatch(torch.randint(0, eng.vocab_size, (20,), generator=g), [a, b], [12, 8]))
    ids = torch.randint(0, eng.vocab_size, (7,), generator=g)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1],
                         [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)  # a 5-node tree, then a 2-token chain

    def forward():
        out = eng.forward(ForwardBatch(ids, [a, b], [5, 2], tree_mask=mask, logit_stats=True))
        eng.rollback(a, 12)
        eng.rollback(b, 8)
        return _facts(out)

    _same_bits_at((1, 2, 3), forward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_long_sequence_is_bit_identical_at_every_thread_count(dtype):
    """One sequence of 17 new tokens: the attention cuts its queries into as many blocks per KV head as the threads
    divide (tiny: 2 KV heads x 3 blocks; 4 threads: x 4), so the blocks change with the thread count; no value may."""
    from specdec.engine.interface import ForwardBatch

    eng = _tiny(dtype, 1)
    g = torch.Generator().manual_seed(2)
    a = eng.allocate_slot()
    eng.forward(ForwardBatch(torch.randint(0, eng.vocab_size, (20,), generator=g), [a], [20]))
    ids = torch.randint(0, eng.vocab_size, (17,), generator=g)

    def forward():
        out = eng.forward(ForwardBatch(ids, [a], [17], logit_stats=True))
        eng.rollback(a, 20)
        return _facts(out)

    _same_bits_at((1, 2, 3, 4), forward)
