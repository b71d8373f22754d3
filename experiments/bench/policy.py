"""Speculation policies side by side (#44): plain, static and goodput speculation on the default model, in one run.

    python -m experiments.bench.policy [--experiment ngram] [--categories summarization,rag,coding,writing]
                                       [--per-category 2] [--max-tokens 96] [--batch 12] [--threads 2] [--out r.json]
    python -m experiments.bench.policy --experiment eagle3_ngram --categories all --per-category 5 --batch 1
    python -m experiments.bench.policy --per-category 1 --max-tokens 16 --batch 4   # a quick check that it runs
    python -m experiments.bench.policy ... --aa   # and plain once more as a config: the table's noise floor (A/A)

Two parts, greedy, the first turn of each prompt with the chat template, one target engine shared by every config
(``LLM.with_speculation``):
- batch 1: Spec-Bench's ``--categories``, ``--per-category`` prompts each; each prompt runs under every config
  before the next starts (the order rotating), so machine noise hits all alike;
- serving-like: ``--batch`` prompts (MT-bench's first turns, then the categories above) submitted at once, the
  engine batching up to ``--batch`` requests; each config runs the same set once.
Configs: ``plain``; ``static`` = ``--experiment``'s speculative config exactly as ``python -m specdec.run
+experiment=<name>`` composes it from conf/ (ngram: k = 10, n 1..3, every step; eagle3_ngram: the EAGLE-3 tree with
its n-gram branch, the full budget every step); ``goodput`` = the same config under ``speculation_policy=goodput``
(specdec/spec_decode/policy.py; its cost table is measured at start-up and refreshed as it runs; for a tree it
chooses the node budget). Per config: tokens/s (total tokens / total
seconds), the ratio to plain (a ratio of means, specdec/experiment/speedup.py), tau, the mean chosen k, the share of
row-steps at k = 0, the share of steps that ran the plain path (every row at k = 0: SpecDecodeWorker._plain_decode)
and greedy mismatches against plain. ~3-5 minutes at the defaults on 2 cores. Run it alone on the machine: the wall
times are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.experiment.speedup import ratio_of_means

CONFIGS = ("plain", "static", "goodput")


def configs(experiment: str) -> dict[str, dict | None]:
    """name -> speculative_config (None = plain): the experiment as conf/ composes it, static and goodput."""
    from experiments.bench.ab import REPO, experiment_spec

    spec = experiment_spec(REPO, experiment)
    if not spec:
        raise SystemExit(f"policy: +experiment={experiment} does not speculate; name one that does "
                         "(ngram, eagle3_ngram)")
    static = {k: v for k, v in spec.items() if k != "policy_options"}  # the goodput policy's options (static takes none)
    return {"plain": None, "static": {**static, "speculation_policy": "static"},
            "goodput": {**spec, "speculation_policy": "goodput"}}


def prompt_ids(llm, categories: list[str], per_category: int) -> list[tuple[str, list[int]]]:
    from specdec.experiment.data import load_spec_bench

    return [(p.category, llm.chat_prompt_ids([{"role": "user", "content": p.turns[0]}]))
            for p in load_spec_bench(categories, per_category)]


def counters(llm) -> tuple[int, int, dict[int, int], tuple[int, int]]:
    """(request decode steps, emitted tokens, chosen-k counts, (plain-path, speculative) batch steps) so far: the
    figures are their deltas."""
    m = llm.get_metrics()
    w = llm.worker
    return (m.num_steps, m.num_emitted_tokens, dict(getattr(w, "chosen_counts", {})),
            (getattr(w, "plain_steps", 0), getattr(w, "spec_steps", 0)))


def delta(before, after) -> dict:
    steps, emitted = after[0] - before[0], after[1] - before[1]
    plain, spec = after[3][0] - before[3][0], after[3][1] - before[3][1]
    ks = {k: n - before[2].get(k, 0) for k, n in after[2].items()}
    n = sum(ks.values())
    return {"tau": emitted / steps if steps else None,
            "mean_chosen_k": sum(k * c for k, c in ks.items()) / n if n else None,
            "k0_share": ks.get(0, 0) / n if n else None,
            # batch steps that ran the plain path, of all batch decode steps (num_steps counts a request's steps)
            "plain_step_share": plain / (plain + spec) if plain + spec else None}


def generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from specdec import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def read_rate() -> float:
    """GB/s of ``W.sum()`` over 256 MB: the machine's state, printed beside absolute figures."""
    w = torch.ones(64 * 1024 * 1024)
    w.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        w.sum()
    return 3 * w.numel() * 4 / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> dict:
    from specdec import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--experiment", default="ngram", help="conf/experiment/<name>.yaml: the speculative config")
    ap.add_argument("--categories", default="summarization,rag,coding,writing", help="names, all or mt_bench")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aa", action="store_true", help="also run plain a second time as its own config, plain_again, "
                    "interleaved like the others: its ratio to plain per category is this host's noise floor for the "
                    "table's ratios (an A/A test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = LLM(args.model, max_num_seqs=max(args.batch, 1), max_model_len=4096)
    specs = configs(args.experiment)
    if args.aa:
        specs["plain_again"] = None
    llms = {name: base if spec is None else base.with_speculation(spec) for name, spec in specs.items()}
    for llm in llms.values():  # one-off costs (allocator, kernels; goodput: its cost table) out of the figures
        generate(llm, [[1, 2, 3, 4, 5, 6, 7, 8] * 4], 16)
    rate0 = read_rate()
    result: dict = {"args": vars(args), "read_gb_s_start": rate0, "batch1": {}, "batch": {}}

    # ---- batch 1, per category
    cats = args.categories if args.categories in ("all", "mt_bench") else args.categories.split(",")
    prompts = prompt_ids(base, cats, args.per_category)
    names = list(specs)  # CONFIGS, then plain_again with --aa
    pairs: dict[str, dict[str, list[tuple[int, float]]]] = {n: {} for n in names}
    outs: dict[str, list[list[int]]] = {n: [] for n in names}
    before = {n: counters(llm) for n, llm in llms.items()}
    for i, (cat, ids) in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            (toks,), secs = generate(llms[name], [ids], args.max_tokens)
            pairs[name].setdefault(cat, []).append((len(toks), secs))
            outs[name].append(toks)
    for name, llm in llms.items():
        rows = {cat: {"tokens_per_s": sum(t for t, _ in p) / sum(s for _, s in p),
                      "vs_plain": ratio_of_means(p, pairs["plain"][cat])} for cat, p in pairs[name].items()}
        allp = [x for p in pairs[name].values() for x in p]
        rows["overall"] = {"tokens_per_s": sum(t for t, _ in allp) / sum(s for _, s in allp),
                           "vs_plain": ratio_of_means(allp, [x for p in pairs["plain"].values() for x in p])}
        result["batch1"][name] = {"per_category": rows, **delta(before[name], counters(llm)),
                                  "greedy_mismatches": sum(a != b for a, b in zip(outs[name], outs["plain"]))}

    # ---- serving-like batch
    if args.batch > 1:
        from specdec.experiment.data import load_spec_bench

        qs = [base.chat_prompt_ids([{"role": "user", "content": p.turns[0]}])
              for p in load_spec_bench("mt_bench", None)][: args.batch]
        qs += [ids for _, ids in prompts][: max(0, args.batch - len(qs))]
        ref = None
        for name, llm in llms.items():
            b0 = counters(llm)
            toks, secs = generate(llm, qs, args.max_tokens)
            ref = toks if name == "plain" else ref
            n = sum(len(t) for t in toks)
            result["batch"][name] = {"tokens_per_s": n / secs, **delta(b0, counters(llm)),
                                     "greedy_mismatches": sum(a != b for a, b in zip(toks, ref))}
        p = result["batch"]["plain"]["tokens_per_s"]
        for r in result["batch"].values():
            r["vs_plain"] = r["tokens_per_s"] / p
    result["read_gb_s_end"] = read_rate()
    if args.out:  # before the tables: a long run's figures are kept whatever the printing does
        Path(args.out).write_text(json.dumps(result, indent=2))
    print_tables(result, list(dict.fromkeys(cat for cat, _ in prompts)))  # the categories run, in order
    if args.out:
        print(args.out)
    return result


def print_tables(result: dict, cats: list[str]) -> None:
    def f(x, fmt=".2f"):
        return "-" if x is None else format(x, fmt)

    print(f"\n+experiment={result['args']['experiment']}, batch 1 "
          f"(read rate {result['read_gb_s_start']:.1f} -> {result['read_gb_s_end']:.1f} GB/s)")
    cols = cats + ["overall"]
    print("| config | " + " | ".join(f"{c} tok/s (x plain)" for c in cols)
          + " | tau | mean k | k=0 share | plain steps | mismatches |")
    print("|---" * (len(cols) + 6) + "|")
    for name, r in result["batch1"].items():
        cells = [f"{f(r['per_category'][c]['tokens_per_s'], '.1f')} ({f(r['per_category'][c]['vs_plain'])})"
                 for c in cols if c in r["per_category"]]
        print(f"| {name} | " + " | ".join(cells) + f" | {f(r['tau'])} | {f(r['mean_chosen_k'])} | "
              f"{f(r['k0_share'])} | {f(r['plain_step_share'])} | {r['greedy_mismatches']} |")
    if result["batch"]:
        print(f"\nbatch {result['args']['batch']} (all submitted at once)")
        print("| config | tok/s | x plain | tau | mean k | k=0 share | plain steps | mismatches |\n"
              "|---|---|---|---|---|---|---|---|")
        for name, r in result["batch"].items():
            print(f"| {name} | {r['tokens_per_s']:.1f} | {f(r['vs_plain'])} | {f(r['tau'])} | "
                  f"{f(r['mean_chosen_k'])} | {f(r['k0_share'])} | {f(r['plain_step_share'])} | "
                  f"{r['greedy_mismatches']} |")


if __name__ == "__main__":
    main()
