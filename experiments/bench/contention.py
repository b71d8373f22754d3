"""A one-token forward quiet, then beside a competing busy process, in one run: ``python experiments/bench/contention.py``.

Issue #43 item 3: on the 2-core boxes a spin-waiting OpenMP pool collapsed beside one busy process (a bf16
one-token forward 1,666 ms instead of 15). This loads SmolLM2 (``--model``), prefills ``--context`` tokens, times
``--reps`` one-token forwards quiet, then starts ``--hogs`` processes running ``while True: pass`` (pinned to the
last cores with ``--pin``, else where the scheduler puts them), times the same forwards again, stops the hogs and
prints both medians and their ratio (target <= 2x). The figures mean something only on an otherwise quiet box:
the script prints the load average before it starts; compare runs only from one box.

    python experiments/bench/contention.py                      # engine defaults (dtype auto, its threads)
    python experiments/bench/contention.py --pin --dtype float32
    GOMP_SPINCOUNT=0 python experiments/bench/contention.py       # block at once (the default until 2026-11-29)
    SPECDEC_ADAPT_THREADS=0 python experiments/bench/contention.py  # every thread, always (no governor)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import specdec  # noqa: F401  (before torch: it sets OMP_WAIT_POLICY=passive unless the environment says otherwise)


def busy_processes(n: int, pin: bool) -> list[subprocess.Popen]:
    """``n`` processes spinning in Python; pinned to the last ``n`` cores with ``pin``."""
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(n):
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        if pin:
            os.sched_setaffinity(p.pid, {cpus[-1 - i % len(cpus)]})
        procs.append(p)
    time.sleep(0.5)  # let them reach the spin
    return procs


def time_forwards(engine, slot: int, context: int, reps: int) -> list[float]:
    """ms of ``reps`` one-token forwards at position ``context`` (rolled back after each)."""
    import torch

    from specdec.engine.interface import ForwardBatch

    tok = torch.tensor([1])
    out = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        engine.forward(ForwardBatch(tok, [slot], [1]))
        out.append((time.perf_counter() - t) * 1e3)
        engine.rollback(slot, context)
    return out[2:]  # two warm-ups


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hogs", type=int, default=1, help="competing busy processes")
    ap.add_argument("--pin", action="store_true", help="pin each busy process to one core")
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}; cores: {len(os.sched_getaffinity(0))}", flush=True)

    import torch

    from specdec.engine.interface import ForwardBatch
    from specdec.engine.loader import load_engine

    eng = load_engine(args.model, num_slots=1, max_model_len=args.context + 8, dtype=args.dtype)
    slot = eng.allocate_slot()
    ids = torch.randint(0, eng.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    eng.forward(ForwardBatch(ids, [slot], [args.context], logits_indices=torch.tensor([args.context - 1])))
    print(f"engine: {eng.describe()}; torch threads {torch.get_num_threads()}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    from specdec.engine.cpu.threads import governor

    gov = governor()
    quiet = time_forwards(eng, slot, args.context, args.reps)
    quiet_reduced = gov.reduced_forwards
    hogs = busy_processes(args.hogs, args.pin)
    try:
        busy = time_forwards(eng, slot, args.context, args.reps)
        busy_reduced = gov.reduced_forwards - quiet_reduced
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    q, b = statistics.median(quiet), statistics.median(busy)
    res = {"quiet_ms": q, "busy_ms": b, "ratio": b / q, "quiet_min_ms": min(quiet), "busy_min_ms": min(busy),
           "quiet_reduced": quiet_reduced, "busy_reduced": busy_reduced}
    print(f"one-token forward, median of {args.reps}: quiet {q:.1f} ms, beside {args.hogs} busy "
          f"{'pinned' if args.pin else 'unpinned'} process(es) {b:.1f} ms: {b / q:.2f}x (target <= 2x); forwards "
          f"with fewer threads (engine/cpu/threads.py): quiet {quiet_reduced}, beside {busy_reduced} of "
          f"{args.reps + 2}")
    return res


if __name__ == "__main__":
    main()
