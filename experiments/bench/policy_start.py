"""What the goodput policy starts from, process by process: the cost table it calibrates at start-up and what it then
chooses, request by request.

    python -m experiments.bench.policy_start [--experiment eagle] [--processes 3] [--prompts 8] [--max-tokens 128]

Each process (a fresh interpreter, as a run is) loads the target with the experiment's speculative_config (composed
by conf/ as ``python -m specdec.run +experiment=NAME`` composes it), prints its calibrated table (one sequence's
forward over 1..64 rows after a short prefix), then answers the first ``--prompts`` MT-bench first turns greedily
one by one and prints per request: the policy's choices (number -> steps), tokens/s, the learnt draft cost per row
and the batch-wide node hit rates. The table is one draw of the host at start-up; this shows how much it moves
between processes and what the policy does with it (LOG 2026-12-05 16:16-: a table taken in a fast memory phase
priced 11 rows at 2.3 one-row forwards against 1.3 in the others, and that process decoded its first three
requests plainly).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.bench.ab import REPO

WORKER = r'''
import json, sys, time
args = json.loads(sys.argv[1])
import torch
torch.set_num_threads(args["threads"])
from specdec import LLM, SamplingParams
from specdec.experiment.data import load_spec_bench
llm = LLM(args["model"], dtype="auto", max_num_seqs=1, max_model_len=4096, speculative_config=args["spec"])
w = llm.worker
c = w.cost
print(json.dumps({"table_rows": c.rows, "table_ms": [s * 1e3 for s in c.secs]}), flush=True)
sp = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
for q in list(load_spec_bench("mt_bench"))[: args["prompts"]]:
    before = dict(w.chosen_counts)
    ids = llm.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t
    chosen = {k: v - before.get(k, 0) for k, v in sorted(w.chosen_counts.items()) if v - before.get(k, 0)}
    hits = [h / n if n else None for h, n in getattr(w.policy, "global_hits", [])[:6]]
    print(json.dumps({"question": q.question_id, "chosen": chosen, "tokens_per_s": len(out.outputs[0].token_ids) / dt,
                      "per_row_ms": c.per_row * 1e3, "hits": hits}), flush=True)
'''


def describe(table_rows: list[int], table_ms: list[float]) -> str:
    """One line: each width's forward in ms and as a multiple of the one-row forward."""
    t1 = table_ms[0] if table_ms else float("nan")
    return "  ".join(f"{r}:{ms:.2f} ({ms / t1:.2f})" for r, ms in zip(table_rows, table_ms))


def main(argv: list[str] | None = None) -> list[list[dict]]:
    from experiments.bench.ab import experiment_spec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="eagle")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    spec = experiment_spec(REPO, a.experiment)
    if spec is None:
        raise SystemExit(f"+experiment={a.experiment} decodes plainly: no policy to show")
    args = json.dumps({"spec": spec, "model": a.model, "prompts": a.prompts, "max_tokens": a.max_tokens,
                       "threads": a.threads})
    runs = []
    for p in range(a.processes):
        res = subprocess.run([sys.executable, "-c", WORKER, args], cwd=REPO, text=True, capture_output=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        if res.returncode != 0:
            raise RuntimeError(f"process {p} failed:\n{res.stderr[-2000:]}")
        lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        runs.append(lines)
        print(f"process {p}: table ms (x one row): {describe(lines[0]['table_rows'], lines[0]['table_ms'])}")
        for r in lines[1:]:
            hits = ", ".join("-" if h is None else f"{h:.2f}" for h in r["hits"])
            print(f"  {r['question']}: {r['tokens_per_s']:.1f} tok/s  chosen {r['chosen']}  draft/row "
                  f"{r['per_row_ms']:.2f} ms  node hits [{hits}]")
    return runs


if __name__ == "__main__":
    main()
