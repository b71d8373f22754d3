"""What more rows cost: the target's forward of M new tokens against one, at several contexts, and the LM-head
product alone (the part with no context in it), in one process, cases interleaved within each repetition.

    python -m experiments.bench.rows --contexts 16,400,900 --rows 7 --reps 25 --threads 2

Prints, per context, the min and median of t(1) and t(M) (a tree's M tokens scored with a tree mask and depth
positions, as scorers/tree.py does) and their ratio; then ``ops.linear`` over the LM head for 1..max rows. The
read rate (``W.sum()``) is printed beside them: compare figures within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec_kernels.tree import build_tree_mask_ref
from specdec.engine.bench import read_rate_gbs, weight_bytes
from specdec.engine.cpu import ops
from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import DEFAULT_MODEL, load_engine


def interleaved(cases: dict, reps: int) -> dict[str, tuple[float, float]]:
    """{name: fn} -> {name: (min ms, median ms)}, each case once per repetition, after one warm-up each."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for k, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--contexts", default="16,400,900")
    ap.add_argument("--rows", type=int, default=7, help="M: 7 = the default EAGLE tree (3 x 3 x 6) and its root")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    contexts = [int(c) for c in a.contexts.split(",")]
    eng = load_engine(a.model, num_slots=1, max_model_len=max(contexts) + a.rows + 8, dtype="float32")
    g = torch.Generator().manual_seed(0)
    # a 3 x 3 x 6 tree when M = 7 (root, 3 children, 2 under the first, 1 under that); else a chain
    parents = [-1, 0, 0, 0, 1, 1, 4] if a.rows == 7 else list(range(-1, a.rows - 1))
    mask = build_tree_mask_ref(torch.tensor(parents))  # [M, M] ancestor-or-self
    depth = mask.sum(-1) - 1  # [M]
    rate = read_rate_gbs(weight_bytes(eng))
    print(f"model={a.model} threads={torch.get_num_threads()} rows={a.rows} reps={a.reps}; read rate {rate:.1f} GB/s, "
          f"{weight_bytes(eng) / 1e6:.0f} MB of weights = {weight_bytes(eng) / rate / 1e6:.2f} ms at that rate")
    print(f"  {'context':>7} | {'t(1) min/med ms':>16} | {'t(M) min/med ms':>16} | t(M)/t(1) min, med")
    s = eng.allocate_slot()
    for ctx in contexts:
        eng.rollback(s, 0)
        eng.forward(ForwardBatch(torch.randint(0, eng.vocab_size, (ctx,), generator=g), [s], [ctx],
                                 logits_indices=torch.tensor([ctx - 1])))

        def one(ctx=ctx):
            eng.rollback(s, ctx)
            eng.forward(ForwardBatch(torch.randint(0, eng.vocab_size, (1,), generator=g), [s], [1]))

        def tree(ctx=ctx):
            eng.rollback(s, ctx)
            eng.forward(ForwardBatch(torch.randint(0, eng.vocab_size, (a.rows,), generator=g), [s], [a.rows],
                                     positions=ctx + depth, tree_mask=mask))

        r = interleaved({"1": one, "M": tree}, a.reps)
        print(f"  {ctx:>7} | {r['1'][0]:7.2f} / {r['1'][1]:6.2f} | {r['M'][0]:7.2f} / {r['M'][1]:6.2f} | "
              f"{r['M'][0] / r['1'][0]:.2f}, {r['M'][1] / r['1'][1]:.2f}")
    lm = eng._stack.lm_head if hasattr(eng, "_stack") else ops.NativeWeight(eng.model.lm_head.w_t)
    N, K = lm.shape
    xs = {m: torch.randn(m, K, generator=g) for m in range(1, a.rows + 2)}
    r = interleaved({m: (lambda x=x: ops.linear(x, lm)) for m, x in xs.items()}, a.reps)
    print(f"  LM head [{N}, {K}] alone, rows: " + "  ".join(
        f"{m}: {r[m][0] / r[1][0]:.2f}/{r[m][1] / r[1][1]:.2f}" for m in xs) + f"  (t(1) {r[1][0]:.2f} ms; min/med ratios)")


if __name__ == "__main__":
    main()
