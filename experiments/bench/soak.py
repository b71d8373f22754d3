"""Soak: many mixed requests with aborts on the tiny model; memory and step time must not grow (issue #16).

    python -m experiments.bench.soak [--requests 20000] [--abort 0.2] [--method plain|ngram] [--threads 1]

1. Soak: ``--requests`` requests (prompt 1-40 tokens, greedy / sampled / seeded, 1-8 new tokens) are queued
   at once; a random ``--abort`` share of them is aborted, one per step, while waiting or running. Checks
   every request comes back exactly once, no slot leaks, no error; prints RSS once 10% have come back
   (warm) and at the end, and what the engine still holds.
2. Step time vs queue length: two LLMs decode side by side, one with 8 requests queued, one with
   ``--requests`` queued (all long, so the queues stay full); their decode steps alternate, so machine
   noise hits both alike. Prints the median step time of each, and the mean cost of aborting one of the
   50 newest waiting requests with 58 and with ``--requests`` queued.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from specdec import LLM, SamplingParams

METHODS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


def rss_mb() -> float:
    """Resident set size of this process, MB (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def mixed_request(rng: random.Random, i: int) -> tuple[dict, SamplingParams]:
    prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))]
    kind = i % 3  # greedy, sampled, seeded
    sp = SamplingParams(temperature=0.0 if kind == 0 else 0.9, top_p=1.0 if kind else 0.95,
                        seed=i if kind == 2 else None, max_tokens=rng.randint(1, 8), ignore_eos=True)
    return {"prompt_token_ids": prompt}, sp


@dataclass
class SoakResult:
    requests: int
    aborted: int
    returned: int
    errors: int
    steps: int
    seconds: float
    rss_start_mb: float
    rss_warm_mb: float
    rss_end_mb: float
    held: dict[str, int] = field(default_factory=dict)  # what the engine still holds at the end


def engine_holds(llm: LLM) -> dict[str, int]:
    eng, sched = llm.llm_engine, llm.llm_engine.scheduler
    held = {"groups": len(eng.groups), "prompts": len(eng.prompts), "errors": len(eng.errors),
            "finished": len(eng._finished), "waiting": len(sched.waiting), "running": len(sched.running),
            "unclaimed": len(llm._unclaimed), "step_times": len(eng.step_times or []),
            "used_slots": llm.engine.num_slots - llm.engine.num_free_slots()}
    hs = getattr(llm.worker, "hidden_states", None)
    held["hidden_state_rows"] = 0 if hs is None else hs.hidden_states.shape[0]
    return held


def soak(llm: LLM, n: int, abort_frac: float = 0.2, seed: int = 0) -> SoakResult:
    """Queue ``n`` mixed requests, abort ``abort_frac`` of them one per step, run to the end."""
    rng = random.Random(seed)
    rss_start = rss_mb()
    ids = [llm.add_request(*mixed_request(rng, i)) for i in range(n)]
    to_abort = rng.sample(ids, int(abort_frac * n))
    seen: dict[str, int] = {}
    reasons: dict[str, str] = {}
    errors = steps = 0
    rss_warm = None
    t0 = time.perf_counter()
    while llm.has_unfinished_requests() or to_abort:
        if to_abort:
            llm.abort(to_abort.pop())
        for out in llm.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
            reasons[out.request_id] = out.outputs[0].finish_reason
            errors += out.error is not None and out.outputs[0].finish_reason == "error"
        steps += 1
        if rss_warm is None and len(seen) >= n // 10:
            rss_warm = rss_mb()
    for out in llm.step():  # anything aborted after the last step
        seen[out.request_id] = seen.get(out.request_id, 0) + 1
        reasons[out.request_id] = out.outputs[0].finish_reason
    dt = time.perf_counter() - t0
    if sorted(seen) != sorted(ids) or any(c != 1 for c in seen.values()):
        raise AssertionError(f"soak: {len(seen)} of {n} requests came back, "
                             f"{sum(c > 1 for c in seen.values())} more than once")
    return SoakResult(requests=n, aborted=sum(r == "abort" for r in reasons.values()), returned=len(seen),
                      errors=errors, steps=steps, seconds=dt, rss_start_mb=rss_start,
                      rss_warm_mb=rss_warm or rss_mb(), rss_end_mb=rss_mb(), held=engine_holds(llm))


def queued_llm(method: str, queued: int, max_num_seqs: int = 8) -> LLM:
    """An LLM with ``queued`` long requests queued and its first batch prefilled (decode steps next)."""
    llm = LLM("tiny-random-llama", max_num_seqs=max_num_seqs, max_model_len=512, speculative_config=METHODS[method])
    sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(queued):
        llm.add_request({"prompt_token_ids": [3 + (i + j) % 500 for j in range(8)]}, sp)
    llm.step()  # the prefill of the first max_num_seqs
    return llm


def step_time_vs_queue(method: str, small: int, large: int, steps: int) -> dict[str, float]:
    """Median decode-step seconds with ``small`` vs ``large`` requests queued, steps alternating, and the
    mean seconds of one abort (of a request deep in the waiting queue) at each."""
    a, b = queued_llm(method, small), queued_llm(method, large)
    ta, tb = [], []
    for _ in range(steps):
        for llm, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t0)
    return {"step_small_s": statistics.median(ta), "step_large_s": statistics.median(tb),
            "abort_small_s": abort_cost(small + 50), "abort_large_s": abort_cost(large)}


def abort_cost(queued: int, n: int = 50) -> float:
    """Mean seconds to abort one of the ``n`` most recently queued requests with ``queued`` waiting."""
    llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    ids = [llm.add_request({"prompt_token_ids": [5, 6, 7]}, sp) for _ in range(queued)]
    t0 = time.perf_counter()
    for rid in ids[-n:]:
        llm.abort(rid)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--abort", type=float, default=0.2)
    ap.add_argument("--method", choices=list(METHODS), default="plain")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200, help="alternating decode steps per LLM in part 2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=128, speculative_config=METHODS[args.method])
    r = soak(llm, args.requests, args.abort)
    print(f"soak ({args.method}): {r.requests} requests, {r.aborted} aborted, {r.returned} returned once each, "
          f"{r.errors} errors, {r.steps} steps in {r.seconds:.1f} s ({1e3 * r.seconds / r.steps:.2f} ms/step)")
    print(f"RSS: start {r.rss_start_mb:.1f} MB, warm (10% back) {r.rss_warm_mb:.1f} MB, end {r.rss_end_mb:.1f} MB "
          f"(end / warm = {r.rss_end_mb / r.rss_warm_mb:.3f})")
    print(f"held at the end: {r.held}")
    del llm

    t = step_time_vs_queue(args.method, 8, args.requests, args.steps)
    print(f"decode step, median of {args.steps}: {1e3 * t['step_small_s']:.2f} ms with 8 queued, "
          f"{1e3 * t['step_large_s']:.2f} ms with {args.requests} queued "
          f"(ratio {t['step_large_s'] / t['step_small_s']:.2f})")
    print(f"abort of a waiting request: {1e6 * t['abort_small_s']:.1f} us with 58 queued, "
          f"{1e6 * t['abort_large_s']:.1f} us with {args.requests} queued")


if __name__ == "__main__":
    main()
