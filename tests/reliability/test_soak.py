"""Soak (issue #16), the short version of experiments/bench/soak.py: 2,000 mixed requests with 20% aborts
on the tiny model, plain and speculative. Every request comes back exactly once, nothing errors, no slot
leaks, and the engine holds nothing afterwards (no outputs, timings or hidden-state rows kept); RSS stays
flat; a decode step costs the same with 20,000 requests queued as with 8 (their steps alternate, so
machine noise hits both alike), and so does an abort."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM


@pytest.fixture(scope="module")
def bench():
    from experiments.bench import soak

    return soak


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_2000_mixed_requests_with_aborts_leave_nothing_behind(bench, method):
    llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=128, speculative_config=bench.METHODS[method])
    r = bench.soak(llm, 2000, abort_frac=0.2, seed=1)
    assert r.returned == 2000 and r.errors == 0
    assert 200 <= r.aborted <= 400  # some of the 400 picked had finished before their turn
    assert set(r.held.values()) == {0}, r.held
    assert r.rss_end_mb <= 1.1 * r.rss_warm_mb, (r.rss_warm_mb, r.rss_end_mb)
    assert llm.get_metrics().num_steps > 0  # running counters, not kept outputs, still give the metrics


def test_step_and_abort_cost_do_not_grow_with_the_queue(bench):
    t = bench.step_time_vs_queue("plain", 8, 20000, steps=30)
    assert t["step_large_s"] < 2 * t["step_small_s"], t
    assert t["abort_large_s"] < 20 * t["abort_small_s"] + 20e-6, t  # was O(queue): ~1 ms at 20k
