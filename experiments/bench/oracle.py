"""How far a speculation policy is from the best any policy could do with the same drafts (#44): the hindsight bound.

    python -m experiments.bench.oracle [--experiment ngram] [--categories summarization,rag] [--per-category 5]
                                       [--max-tokens 128] [--threads 2] [--out r.json]

For a free-draft chain proposer (n-gram: its drafts are a function of the tokens alone), greedy. Per prompt, in one
run, plain decoding and the experiment under ``speculation_policy=goodput`` (the order alternating), each timed, and
the prompt's prefill alone (a 1-token request). Then, offline, from plain's output: at every position i (i output
tokens committed, the last one pending) the proposer's draft of up to k tokens (proposers/ngram.py's NGramIndex, the
experiment's k and n range) and a(i), how many of them greedy verification accepts. A policy that knew a(i) before
choosing would draft exactly k = a(i) tokens or fewer; the best such schedule for the whole output is a shortest path
(``oracle_seconds``) over the costs of a one-sequence forward of k + 1 rows, measured on the engine after as many
tokens as the category's prompts hold (cost_model.calibrate at that prefix: the fastest of 4 rounds per width).
No policy can beat it with these drafts: drafting past a(i) adds rows and no token, and one that drafted less than
the oracle where a(i) was long could not do better later (the costs rise with k more slowly than the tokens).

The bound is in the measured run's units: plain's measured decode time (wall time less the prefill) scaled by the
oracle's seconds over plain's ((N - 1) one-row forwards), i.e. every step's work outside the forward priced in
proportion; the prefill is the same for every policy. Per category: plain tok/s, the prefill's share of plain's time,
goodput and the bound as a multiple of plain (whole requests, a ratio of means with its bootstrap 95% interval over
the prompts, specdec/experiment/speedup.py; and the decode part alone), and the share of the bound's
gain over plain that goodput took. A ratio of means over the category's prompts, as experiments.bench.policy. Run it
alone on the machine: the wall times are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments.bench.policy import read_rate
from specdec.experiment.speedup import bootstrap_interval, ratio_of_means


def accepted_lengths(prompt: list[int], out: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """[len(out) - 1] a(i) for i = 1 .. len(out) - 1: how many of the n-gram draft's tokens after prompt + out[:i]
    (its last token pending) equal out[i:] (greedy verification), 0 where it drafts nothing."""
    from experiments.bench.ngram_classes import accepted
    from proposers.ngram import NGramIndex

    index = NGramIndex(min_n, max_n)
    toks = list(prompt)
    out_a = []
    for i in range(1, len(out)):
        toks.append(out[i - 1])
        out_a.append(accepted(index.lookup(0, toks, k), out[i:]))
    return out_a


def oracle_seconds(acc: list[int], step: list[float]) -> tuple[float, list[int]]:
    """The fewest seconds to emit the output after its first token, and the k chosen at each step on that schedule.
    ``acc``: [N - 1] a(i) (accepted_lengths); ``step``: [K + 1] seconds of a step drafting k = 0 .. K tokens. A step at
    i drafting k <= a(i) emits k + 1 tokens; the output ends at N = len(acc) + 1."""
    N, K = len(acc) + 1, len(step) - 1
    best = [0.0] * (N + K + 2)  # best[i]: seconds from i to the end (0 at and past N)
    pick = [0] * (N + 1)
    for i in range(N - 1, 0, -1):
        a = min(acc[i - 1], K)
        best[i], pick[i] = min((step[k] + best[i + 1 + k], k) for k in range(a + 1))
    ks, i = [], 1
    while i < N:
        ks.append(pick[i])
        i += 1 + pick[i]
    return best[1], ks


def step_costs(engine, prefix: int, k: int) -> list[float]:
    """[k + 1] seconds of one sequence's forward of 1 .. k + 1 rows after ``prefix`` tokens (the engine's cost table)."""
    from specdec.spec_decode.cost_model import calibrate

    table = calibrate(engine, rows=tuple(range(1, k + 2)), batches=(), prefix=prefix, long_prefix=0, cache=False)
    return [table.base(r) for r in range(1, k + 2)]


def main(argv: list[str] | None = None) -> dict:
    from specdec import LLM, SamplingParams
    from experiments.bench.policy import configs, prompt_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--experiment", default="ngram", help="conf/experiment/<name>.yaml: an n-gram chain")
    ap.add_argument("--categories", default="summarization,rag", help="names, or all")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=None, help="the longest draft the bound may choose and the n-gram drafts "
                    "(default: the experiment's num_speculative_tokens; goodput runs with the same limit)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = configs(args.experiment)["goodput"]
    if "ngram" not in str(spec.get("method", "")):
        raise SystemExit(f"oracle: +experiment={args.experiment} drafts with {spec.get('method')!r}; the bound is "
                         "computed for the n-gram proposer (name an experiment whose method is ngram)")
    if args.k is not None:
        if args.k < 1:
            raise SystemExit(f"oracle: --k {args.k} must be >= 1 (the longest draft)")
        spec = {**spec, "num_speculative_tokens": args.k}
    k, min_n, max_n = spec["num_speculative_tokens"], spec["prompt_lookup_min"], spec["prompt_lookup_max"]
    base = LLM(args.model, max_num_seqs=2, max_model_len=4096)
    llms = {"plain": base, "goodput": base.with_speculation(spec)}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)

    def run(llm, ids, params):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - t0

    for llm in llms.values():  # one-off costs (allocator, kernels; goodput: its cost table) out of the figures
        run(llm, [1, 2, 3, 4, 5, 6, 7, 8] * 4, greedy)
    result: dict = {"args": vars(args), "k": k, "n": [min_n, max_n], "read_gb_s_start": read_rate(), "prompts": []}
    cats = args.categories if args.categories == "all" else args.categories.split(",")
    prompts = prompt_ids(base, cats, args.per_category)
    for j, (cat, ids) in enumerate(prompts):
        row: dict = {"category": cat, "index": j, "prompt_tokens": len(ids)}
        _, row["prefill_s"] = run(base, ids, first)
        for name in (("plain", "goodput") if j % 2 == 0 else ("goodput", "plain")):
            toks, row[f"{name}_s"] = run(llms[name], ids, greedy)
            row[f"{name}_tokens"] = toks
        row["greedy_equal"] = row["plain_tokens"] == row["goodput_tokens"]
        result["prompts"].append(row)
    result["read_gb_s_end"] = read_rate()
    costs: dict[str, list[float]] = {}  # per category, at its mean prompt length (timed after the runs: no drift)
    for cat in dict.fromkeys(r["category"] for r in result["prompts"]):
        lens = [r["prompt_tokens"] for r in result["prompts"] if r["category"] == cat]
        costs[cat] = step_costs(base.engine, min(sum(lens) // len(lens), 4096 - k - 2), k)
    for r in result["prompts"]:
        step = costs[r["category"]]
        out = r.pop("plain_tokens")
        r["goodput_n"] = len(r.pop("goodput_tokens"))
        r["tokens"] = len(out)
        acc = accepted_lengths(prompts[r["index"]][1], out, k, min_n, max_n) if len(out) > 1 else []
        o, ks = oracle_seconds(acc, step)
        plain_steps = (len(out) - 1) * step[0]
        decode = max(r["plain_s"] - r["prefill_s"], 0.0)
        r["oracle_s"] = r["prefill_s"] + (decode * o / plain_steps if plain_steps else 0.0)
        r["oracle_steps"], r["oracle_mean_k"] = len(ks), (sum(ks) / len(ks) if ks else 0.0)
    result["costs_ms"] = {c: [round(s * 1e3, 3) for s in v] for c, v in costs.items()}
    result["per_category"] = summarize(result["prompts"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def summarize(rows: list[dict]) -> dict:
    """Per category and overall: tokens / seconds of each mode, ratios to plain, the prefill's share, the decode part's
    ratios and goodput's share of the bound's gain."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["category"], []).append(r)
    groups["overall"] = rows
    out = {}
    for cat, rs in groups.items():
        n = sum(r["tokens"] for r in rs)
        pre, plain, good, orc = (sum(r[f] for r in rs) for f in ("prefill_s", "plain_s", "goodput_s", "oracle_s"))
        base = [(r["tokens"], r["plain_s"]) for r in rs]
        goodput = [(r["goodput_n"], r["goodput_s"]) for r in rs]
        bound = [(r["tokens"], r["oracle_s"]) for r in rs]
        s = {"plain_tok_s": n / plain, "prefill_share": pre / plain,
             "goodput_x": ratio_of_means(goodput, base), "goodput_x_interval": bootstrap_interval(goodput, base),
             "bound_x": ratio_of_means(bound, base), "bound_x_interval": bootstrap_interval(bound, base),
             # the decode part alone (None where the prefill measured as long as the request: a tiny model's noise)
             "goodput_decode_x": (plain - pre) / (good - pre) if min(plain, good, orc) > pre else None,
             "bound_decode_x": (plain - pre) / (orc - pre) if min(plain, good, orc) > pre else None,
             "greedy_equal": all(r["greedy_equal"] for r in rs)}
        gx, bx = s["goodput_x"], s["bound_x"]
        s["share_of_bound_gain"] = (gx - 1) / (bx - 1) if gx is not None and bx is not None and bx > 1 else None
        out[cat] = s
    return out


def print_table(result: dict) -> None:
    print(f"\n+experiment={result['args']['experiment']} (k = {result['k']}, n {result['n'][0]}..{result['n'][1]}), "
          f"batch 1, greedy (read rate {result['read_gb_s_start']:.1f} -> {result['read_gb_s_end']:.1f} GB/s)")
    print("| category | plain tok/s | prefill share | goodput x plain | bound x plain | goodput decode x | "
          "bound decode x | share of bound's gain | greedy equal |\n|---|---|---|---|---|---|---|---|---|")
    def f(x, fmt=".2f"):
        return "-" if x is None else format(x, fmt)

    def x(v, iv):  # a ratio with its bootstrap 95% interval over the prompts
        return f(v, ".3f") + ("" if iv is None else f" [{iv[0]:.2f}, {iv[1]:.2f}]")

    for cat, s in result["per_category"].items():
        print(f"| {cat} | {s['plain_tok_s']:.1f} | {s['prefill_share']:.2f} | "
              f"{x(s['goodput_x'], s['goodput_x_interval'])} | {x(s['bound_x'], s['bound_x_interval'])} | "
              f"{f(s['goodput_decode_x'])} | {f(s['bound_decode_x'])} | "
              f"{f(s['share_of_bound_gain'])} | {s['greedy_equal']} |")
    print("step costs (ms, k = 0 ..): " + "; ".join(f"{c} {v[0]:.2f} .. {v[-1]:.2f}"
                                                  for c, v in result["costs_ms"].items()))


if __name__ == "__main__":
    main()
