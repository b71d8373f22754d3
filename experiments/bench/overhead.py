"""The framework's overhead per emitted token at num_scheduler_steps N = 1, 4, 8 (issue #47 item 3).

    python -m experiments.bench.overhead                         # SmolLM2-135M, plain and ngram, batch 1 and 8
    python -m experiments.bench.overhead --steps 1,8 --batches 1 --tokens 64 --reps 3

Overhead = time outside the forward and the draft: for each (method, N, batch) the decode phase of one
greedy generate (Spec-Bench prompts, chat template, EOS ignored, every request admitted by one prefill that
is not timed) is timed with the wall clock, and the engine's per-step phase timings (LLMEngine.step_stats:
``forward`` of the plain worker, ``score`` + ``propose`` of the speculative one; summed over a block's
steps under multi-step decoding) are subtracted:

    overhead ms/token = (decode wall - forward - draft) / tokens emitted in the decode phase

so it holds the scheduler, step transactions, sampling / verification, appends, stop checks and output
building. Its ``engine`` part (decode wall - the worker's execute time) is what the step loop itself costs;
the rest is the worker's own work around its forwards (sampling; under speculation verification, commit and
the scorer's and proposer wrapper's Python, which multi-step decoding does not touch). Where N > 1 the plain worker's fast loop asks the engine for its logits' argmax and logsumexp as it
writes them (ForwardBatch.logit_stats), so that work is charged to the forward column: compare the
forward+draft column across N to see it. ``same`` says the tokens equal the N = 1 run's (greedy).

Each rep runs every N once, in an order that rotates from rep to rep (so drift in the machine's speed hits
every N alike); each cell is the median over ``--reps`` of each column (the spread, min-max of ms/token, beside
it). After each (method, batch) a line compares the last N with the first: the tokens/s gained against the
overhead saved, both as a share of N = 1's time per token (#47's target: the gain at least the saving). The read rate (``W.sum()`` over the weights'
bytes, specdec/engine/bench.py) is printed beside the table: absolute figures move with it, and on a box
shared with other work every figure is noise (the load average is printed first; take figures only when it
is near 0). Ratios are against N = 1 of the same method and batch; the target is overhead(N=8) <= 1/3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SPECS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


def decode_phase(llm, prompts: list[list[int]], tokens: int, steps: int) -> tuple[float, int, dict, list]:
    """(decode wall s, tokens emitted after the prefill, step_stats totals, each request's tokens)."""
    from specdec import SamplingParams
    from specdec.datamodel.metrics import StepTimeStats

    eng = llm.llm_engine
    eng.num_scheduler_steps = steps
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    eng.step()  # the prefill of every request (batch <= max_num_seqs): not timed
    eng.step_stats = StepTimeStats()
    outs = {o.request_id: o for o in eng.pop_finished()}
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        outs.update((o.request_id, o) for o in eng.pop_finished())
    wall = time.perf_counter() - t0
    outs.update((o.request_id, o) for o in eng.pop_finished())
    toks = [outs[i].outputs[0].token_ids for i in ids]
    return wall, sum(len(t) for t in toks) - len(prompts), dict(eng.step_stats.total), toks


def cell(runs: list[tuple[float, int, dict, list]], method: str, batch: int, steps: int, rate: float) -> dict:
    """One table cell: the median over reps of each per-token column (ms), and the min-max of ms/token."""
    per = []
    for wall, ntok, tot, _ in runs:
        model = tot.get("forward", 0.0) + tot.get("score", 0.0) + tot.get("propose", 0.0)
        per.append((wall / ntok * 1e3, model / ntok * 1e3, (wall - model) / ntok * 1e3,
                    (wall - tot.get("execute", 0.0)) / ntok * 1e3))
    med = [statistics.median(col) for col in zip(*per)]
    return dict(method=method, batch=batch, steps=steps, tokens_per_s=1e3 / med[0], ms_per_token=med[0],
                model_ms_per_token=med[1], overhead_ms_per_token=med[2], engine_ms_per_token=med[3],
                ms_per_token_min=min(p[0] for p in per), ms_per_token_max=max(p[0] for p in per), reps=len(per),
                read_rate_gbs=rate, toks=runs[0][3])  # toks: popped by main


def verdict(ref: dict, row: dict) -> dict:
    """#47's batch-1 check: tokens/s up at least by the overhead saved, both as % of ``ref``'s ms/token."""
    gain = (row["tokens_per_s"] / ref["tokens_per_s"] - 1) * 100
    saved = (ref["overhead_ms_per_token"] - row["overhead_ms_per_token"]) / ref["ms_per_token"] * 100
    return dict(gain_pct=gain, saved_pct=saved, met=gain >= saved and row["overhead_ratio"] <= 1 / 3)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", default="1,4,8", help="num_scheduler_steps values; the first is the reference")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default="plain,ngram", help=f"of {list(SPECS)}")
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per request")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = ap.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in SPECS]
    if unknown:
        raise SystemExit(f"overhead.py: --methods {unknown} unknown; choose from {list(SPECS)}")

    from specdec import LLM
    from specdec.engine.bench import read_rate_gbs, weight_bytes
    from specdec.experiment.data import load_spec_bench

    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (figures mean something near 0)")
    base = LLM(args.model, max_num_seqs=max(batches), max_model_len=1024, dtype=args.dtype, num_threads=args.threads)
    qs = load_spec_bench()[: max(batches)]  # file order: one per category first
    prompts = [base.chat_prompt_ids([{"role": "user", "content": q.turns[0]}]) for q in qs]
    nbytes = weight_bytes(base.engine)
    rate = read_rate_gbs(nbytes)
    print(f"# {args.model} {base.engine.dtype}, weights {nbytes / 1e6:.0f} MB, read rate {rate:.1f} GB/s "
          f"(one weight read {nbytes / rate / 1e6:.1f} ms), {args.tokens} tokens per request, median of {args.reps} "
          "(N order rotating per rep)")
    print(f"{'method':>6} {'batch':>5} {'N':>3} {'tok/s':>8} {'ms/tok':>8} {'fwd+draft':>9} {'overhead':>9} "
          f"{'engine':>7} {'ratio':>6} {'same':>5}   [min, max ms/tok]  (ms per emitted token)")
    rows = []
    for method in methods:
        llm = base.with_speculation(SPECS[method])
        for b in batches:
            decode_phase(llm, prompts[:b], 8, steps[0])  # warm-up
            runs: dict[int, list] = {n: [] for n in steps}
            for rep in range(args.reps):
                order = steps[rep % len(steps):] + steps[: rep % len(steps)]  # rotating
                for n in order:
                    runs[n].append(decode_phase(llm, prompts[:b], args.tokens, n))
            ref = ref_toks = None
            for n in steps:
                row = cell(runs[n], method, b, n, rate)
                toks = row.pop("toks")
                ref, ref_toks = ref or row, ref_toks or toks
                row["overhead_ratio"] = row["overhead_ms_per_token"] / ref["overhead_ms_per_token"]
                row["same"] = all(r[3] == ref_toks for r in runs[n])  # every rep's tokens equal N = 1's first
                rows.append(row)
                print(f"{method:>6} {b:>5} {n:>3} {row['tokens_per_s']:>8.1f} {row['ms_per_token']:>8.2f} "
                      f"{row['model_ms_per_token']:>9.2f} {row['overhead_ms_per_token']:>9.3f} "
                      f"{row['engine_ms_per_token']:>7.3f} {row['overhead_ratio']:>6.2f} "
                      f"{'yes' if row['same'] else 'NO':>5}   [{row['ms_per_token_min']:.2f}, "
                      f"{row['ms_per_token_max']:.2f}]")
            last = rows[-1]
            v = verdict(ref, last)
            last.update(v)
            print(f"       N={last['steps']} vs N={ref['steps']}: tok/s {v['gain_pct']:+.1f}%, overhead saved "
                  f"{v['saved_pct']:.1f}% of N={ref['steps']}'s ms/token, overhead ratio "
                  f"{last['overhead_ratio']:.2f} -> " + (('met' if v['met'] else 'NOT met') if b == 1 else
                                                         "(#47's tokens/s check is at batch 1: for reference)"))
    return rows


if __name__ == "__main__":
    main()
