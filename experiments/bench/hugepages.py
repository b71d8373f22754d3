"""Packed weights on huge pages against 4 KB pages, side by side in one process (specdec/engine/cpu/hugepages.py).

    python -m experiments.bench.hugepages --dtype bfloat16 --context 512 --reps 15

Two engines of ``--model`` are loaded, one with its packed weights on transparent huge pages and one on ordinary
pages; each case (B = 1 forwards of M new tokens, one-token decode at batch B) runs on both, alternating within each
repetition, after the cases of ``specdec.engine.bench``. Printed per case: each engine's fastest forward, their
ratio, and the median time of a few small torch ops run right after each forward (what a step's Python pays on
the caches a forward leaves). First the read rate (``W.sum()``) over a buffer of the weights' size on each kind of
page, interleaved, and how much of the process sits on huge pages (``AnonHugePages``). Compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec.engine.bench import setup, weight_bytes
from specdec.engine.cpu import hugepages
from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import DEFAULT_MODEL

CASES = [("M", 1), ("M", 5), ("M", 9), ("M", 14), ("M", 17), ("M", 33), ("B", 4), ("B", 16)]


def anon_huge_mb() -> int:
    """MB of this process's anonymous memory on huge pages (0 where /proc says nothing)."""
    try:
        with open(f"/proc/{os.getpid()}/smaps") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")) // 1024
    except OSError:
        return 0


def small_ops() -> None:
    """A handful of the tiny tensor ops a speculative step's Python runs."""
    a = torch.tensor([3, 4])
    a.tolist()
    bool((a == torch.arange(2)).all())
    torch.tensor([[1.0] * 8]).sum(-1).any()
    torch.zeros(4, 16)[torch.tensor([1, 2])].argmax(-1).tolist()


def read_rates(nbytes: int, reps: int) -> tuple[float, float]:
    """(GB/s over 4 KB pages, GB/s over huge pages): ``W.sum()``, the two buffers alternating, the fastest of each."""
    small = torch.ones(nbytes // 4)
    huge = hugepages.empty(nbytes // 4, torch.float32).fill_(1.0) if hugepages.enabled() else torch.ones(nbytes // 4)
    best = [float("inf"), float("inf")]
    for _ in range(reps + 1):
        for i, w in enumerate((small, huge)):
            t = time.perf_counter()
            w.sum()
            best[i] = min(best[i], time.perf_counter() - t)
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    on = hugepages.enabled()
    engines = {}
    for name, huge in (("4K", False), ("huge", True)):
        hugepages._ON = huge and on  # the allocator's switch, read as each engine packs its weights
        engines[name] = setup(a.model, a.context, a.dtype)
    hugepages._ON = None
    nbytes = weight_bytes(engines["4K"][0])
    r4k, rhuge = read_rates(nbytes, 5)
    print(f"model={a.model} dtype={a.dtype} context={a.context} threads={torch.get_num_threads()} reps={a.reps}; "
          f"huge pages offered: {on}; AnonHugePages {anon_huge_mb()} MB; read rate ({nbytes / 1e6:.0f} MB) 4 KB pages "
          f"{r4k:.1f} GB/s, huge pages {rhuge:.1f} GB/s")
    res = {(n, c): ([], []) for n in engines for c in CASES}
    for r in range(a.reps + 1):  # the first repetition warms up
        for kind, m in CASES:
            for name, (eng, slots, lens, g) in engines.items():
                use = [slots[8]] if kind == "M" else slots[:m]
                q = m if kind == "M" else 1
                for s in use:
                    eng.rollback(s, lens[s])
                ids = torch.randint(0, eng.vocab_size, (len(use) * q,), generator=g)
                t0 = time.perf_counter()
                eng.forward(ForwardBatch(ids, use, [q] * len(use)))
                t1 = time.perf_counter()
                small_ops()
                if r:
                    res[(name, (kind, m))][0].append(t1 - t0)
                    res[(name, (kind, m))][1].append(time.perf_counter() - t1)
    print(f"  {'case':>5} | {'4K ms':>7} | {'huge ms':>7} | ratio | small ops after: 4K us | huge us")
    for c in CASES:
        (f4, p4), (fh, ph) = res[("4K", c)], res[("huge", c)]
        print(f"  {c[0]}={c[1]:<3} | {min(f4) * 1e3:7.2f} | {min(fh) * 1e3:7.2f} | {min(fh) / min(f4):5.3f} | "
              f"{statistics.median(p4) * 1e6:21.0f} | {statistics.median(ph) * 1e6:7.0f}")


if __name__ == "__main__":
    main()
