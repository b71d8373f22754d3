"""The small per-step ops that the 2026-11-26 profile of a speculative step pointed at, old against new, in one
process: greedy argmax over a [1, M, V] score (``torch.argmax`` vs ``specdec.sampling.sampler.argmax_last``) and the
EAGLE head's RoPE rows on the native path (``_cos_sin`` computed vs ``_rope_rows`` from its table).

    python -m experiments.bench.step_ops --rows 7 --threads 2
    python -m experiments.bench.step_ops --head checkpoints/smollm2-135m-instruct-eagle3

Min over ``--rounds`` rounds of ``--calls`` calls each, in microseconds per call, with the read rate beside them.
Compare figures within one run only.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.engine.bench import read_rate_gbs
from specdec.sampling.sampler import argmax_last


def best_us(fn, calls: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=7, help="M scored tokens (7 = the default tree and its root)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--head", default="checkpoints/smollm2-135m-instruct-eagle3", help="'' skips the RoPE case")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"threads={torch.get_num_threads()} read rate {read_rate_gbs(512 * 2**20):.1f} GB/s")
    x = torch.randn(1, a.rows, a.vocab, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_last(x), x.argmax(-1))
    print(f"argmax [1, {a.rows}, {a.vocab}]: torch.argmax {best_us(lambda: x.argmax(-1), a.calls, a.rounds):.0f} us, "
          f"argmax_last {best_us(lambda: argmax_last(x), a.calls, a.rounds):.0f} us")
    if a.head:
        from specdec.heads import load_head

        h = load_head(a.head).float().eval()
        h.init_cache(1, 2048, torch.float32, "cpu")
        pos = torch.tensor([300, 301, 301, 302, 302, 302])  # a depth-3 re-feed of the default tree
        print(f"RoPE rows for {pos.numel()} pairs: _cos_sin {best_us(lambda: h._cos_sin(pos, torch.float32), a.calls, a.rounds):.0f}"
              f" us, _rope_rows {best_us(lambda: h._rope_rows(pos), a.calls, a.rounds):.0f} us")


if __name__ == "__main__":
    main()
