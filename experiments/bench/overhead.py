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

Each cell is the rep with the least wall time of ``--reps``. The read rate (``W.sum()`` over the weights'
bytes, specdec/engine/bench.py) is printed beside the table: absolute figures move with it, and on a box
shared with other work every figure is noise (the load average is printed first; take figures only when it
is near 0). Ratios are against N = 1 of the same method and batch; the target is overhead(N=8) <= 1/3.
"""

from __future__ import annotations

import argparse
import os
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


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", default="1,4,8", help="num_scheduler_steps values; the first is the reference")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default="plain,ngram", help=f"of {list(SPECS)}")
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per request")
    ap.add_argument("--reps", type=int, default=2)
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
          f"(one weight read {nbytes / rate / 1e6:.1f} ms), {args.tokens} tokens per request, best of {args.reps}")
    print(f"{'method':>6} {'batch':>5} {'N':>3} {'tok/s':>8} {'ms/tok':>8} {'fwd+draft':>9} {'overhead':>9} "
          f"{'engine':>7} {'ratio':>6} {'same':>5}   (ms per emitted token)")
    rows = []
    for method in methods:
        llm = base.with_speculation(SPECS[method])
        for b in batches:
            ref = None
            decode_phase(llm, prompts[:b], 8, steps[0])  # warm-up
            for n in steps:
                best = min((decode_phase(llm, prompts[:b], args.tokens, n) for _ in range(args.reps)),
                           key=lambda r: r[0])
                wall, ntok, tot, toks = best
                model = tot.get("forward", 0.0) + tot.get("score", 0.0) + tot.get("propose", 0.0)
                over = (wall - model) / ntok * 1e3
                engine = (wall - tot.get("execute", 0.0)) / ntok * 1e3
                ref = ref or (over, toks)
                row = dict(method=method, batch=b, steps=n, tokens_per_s=ntok / wall, ms_per_token=wall / ntok * 1e3,
                           model_ms_per_token=model / ntok * 1e3, overhead_ms_per_token=over,
                           engine_ms_per_token=engine,
                           overhead_ratio=over / ref[0], same=toks == ref[1], read_rate_gbs=rate)
                rows.append(row)
                print(f"{method:>6} {b:>5} {n:>3} {row['tokens_per_s']:>8.1f} {row['ms_per_token']:>8.2f} "
                      f"{row['model_ms_per_token']:>9.2f} {over:>9.3f} {engine:>7.3f} {row['overhead_ratio']:>6.2f} "
                      f"{'yes' if row['same'] else 'NO':>5}")
    return rows


if __name__ == "__main__":
    main()
