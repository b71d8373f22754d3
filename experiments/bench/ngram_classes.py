"""How well n-gram drafts are accepted, by the length of the match they come from (#44: the goodput policy's classes).

    python -m experiments.bench.ngram_classes [--categories all] [--per-category 5] [--max-tokens 128] [--k 10]
                                              [--min-n 1] [--max-n 3] [--out r.json]

Plain greedy decoding of Spec-Bench's first turns (the chat template, batch 1), then, offline, at every position t of
each output (as if a step started there): the n-gram proposer's draft of up to k tokens after the tokens so far
(proposers/ngram.py's NGramIndex, ``--min-n`` .. ``--max-n`` as the proposer's prompt_lookup_min / max), the match
length n it came from (0 = no match, no draft), and how many of its tokens equal the output's next ones (what greedy
verification of that draft accepts). Per n: the share of positions, the mean accepted and P(accepted >= i) for i =
1..k; per category: the mean accepted per n. Every position counts, not only the ones a speculative run would start a
step at, so the figures describe the drafts, not a run's tau. No timing: it can run beside other work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def accepted(draft: list[int], future: list[int]) -> int:
    """Leading tokens of ``draft`` equal to ``future``'s."""
    a = 0
    for d, f in zip(draft, future):
        if d != f:
            break
        a += 1
    return a


def tabulate(rows: list[tuple[str, list[int], list[int]]], k: int, min_n: int, max_n: int) -> dict:
    """``rows``: (category, prompt ids, greedy output ids) -> {"by_n": {n: {...}}, "by_category": {cat: {n: mean}}}."""
    from proposers.ngram import NGramIndex

    by_n: dict[int, dict] = {}
    by_cat: dict[str, dict[int, list[int]]] = {}
    for r, (cat, prompt, out) in enumerate(rows):
        index = NGramIndex(min_n, max_n)
        for t in range(1, len(out)):
            toks = prompt + out[:t]  # the last one is pending, as in a step
            n = index.match_length(r, toks)
            a = accepted(index.lookup(r, toks, k), out[t:]) if n else 0
            s = by_n.setdefault(n, {"positions": 0, "accepted": 0, "at_least": [0] * k})
            s["positions"] += 1
            s["accepted"] += a
            for i in range(a):
                s["at_least"][i] += 1
            c = by_cat.setdefault(cat, {}).setdefault(n, [0, 0])
            c[0] += 1
            c[1] += a
    total = sum(s["positions"] for s in by_n.values()) or 1
    table = {n: {"share": s["positions"] / total, "positions": s["positions"],
                 "mean_accepted": s["accepted"] / s["positions"],
                 "p_at_least": [x / s["positions"] for x in s["at_least"]]} for n, s in sorted(by_n.items())}
    cats = {cat: {n: v[1] / v[0] for n, v in sorted(d.items())} for cat, d in by_cat.items()}
    return {"by_n": table, "by_category": cats}


def main(argv: list[str] | None = None) -> dict:
    from experiments.bench.policy import prompt_ids
    from specdec import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--categories", default="all")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--min-n", type=int, default=1)
    ap.add_argument("--max-n", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_num_seqs=1, max_model_len=4096)
    cats = args.categories.split(",") if "," in args.categories else args.categories
    pool = prompt_ids(llm, cats, args.per_category)
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in pool],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    rows = [(c, ids, list(o.outputs[0].token_ids)) for (c, ids), o in zip(pool, outs)]
    res = tabulate(rows, args.k, args.min_n, args.max_n)
    res["args"] = vars(args)
    print(f"n-gram drafts (k = {args.k}, n {args.min_n}..{args.max_n}) on {len(rows)} greedy outputs, by match length n")
    print("| n | share of positions | mean accepted | " + " | ".join(f"P(>= {i + 1})" for i in range(args.k)) + " |")
    print("|---" * (3 + args.k) + "|")
    for n, s in res["by_n"].items():
        print(f"| {n} | {s['share']:.2f} | {s['mean_accepted']:.2f} | "
              + " | ".join(f"{p:.2f}" for p in s["p_at_least"]) + " |")
    ns = list(res["by_n"])
    print("\n| category | " + " | ".join(f"n = {n}" for n in ns) + " |\n|---" + "|---" * len(ns) + "|")
    for cat, d in res["by_category"].items():
        print(f"| {cat} | " + " | ".join(f"{d[n]:.2f}" if n in d else "-" for n in ns) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(args.out)
    return res


if __name__ == "__main__":
    main()
