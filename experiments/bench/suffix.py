"""Suffix decoding vs transformers' prompt lookup and our n-gram, on the same prompts, in one run.

    python -m experiments.bench.suffix [--per-category 5] [--max-tokens 128] [--sets spec_bench,repetitive]
                                       [--methods plain,suffix,suffix_tree,ngram,hf,hf_pld]
                                       [--pld-k 3,5,10] [--threads 2] [--dtype auto] [--hf-dtype float32] [--out results.json]
    python -m experiments.bench.suffix --per-category 1 --max-tokens 32        # a quick check that it runs

Greedy, batch 1, the first turn of each prompt with the chat template, on two prompt sets:
- ``spec_bench``: Spec-Bench's 13 categories (specdec/assets/spec_bench_question.jsonl), ``--per-category`` each;
- ``repetitive``: code editing and text rewriting prompts whose answer repeats most of the prompt
  (data/repetitive/prompts.jsonl, written by ``--write-prompts``; see data/repetitive/CARD.md), its own
  categories, ``--per-category`` each.
Methods (every method runs a prompt before the next prompt starts, so machine noise hits all alike):
``plain`` (our engine), ``suffix`` (method=suffix, chains of ``--k``, scorer mqa), ``suffix_tree`` (the same
tries, trees of ``--tree-budget`` nodes and ``--tree-depth`` deep, scorer tree), ``ngram`` (our prompt lookup,
k=10, n 1..3, conf/proposer/ngram.yaml), ``hf`` (transformers' plain ``generate``) and ``hf_pld``
(``generate(..., prompt_lookup_num_tokens=N)`` for each N in ``--pld-k``; "best" = the best N per category).
Our methods' speedups are over our plain decoding, transformers' over its own plain ``generate``: each is the ratio
of means (total tokens / total seconds of each side, specdec/experiment/speedup.py). Prints tokens/s, tau and speedup per category and overall,
the greedy mismatches against our plain decoding, and the machine's read rate (``W.sum()``) at the start and the
end: compare absolute figures only within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec.experiment.speedup import ratio_of_means

REPO = Path(__file__).resolve().parents[2]
REPETITIVE = REPO / "data" / "repetitive" / "prompts.jsonl"

# ------------------------------------------------------------------------------------------ the repetitive set
_CODE = {
    "stack": '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def size(self):
        return len(self.items)
''',
    "stats": '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)


def describe(values):
    print("count:", len(values))
    print("mean:", mean(values))
    print("variance:", variance(values))
''',
    "inventory": '''def add_item(inventory, name, count):
    if name in inventory:
        inventory[name] += count
    else:
        inventory[name] = count
    return inventory


def remove_item(inventory, name, count):
    if name not in inventory:
        return inventory
    inventory[name] -= count
    if inventory[name] <= 0:
        del inventory[name]
    return inventory


def total_items(inventory):
    return sum(inventory.values())
''',
    "server": '''function startServer(port) {
  const server = http.createServer((req, res) => {
    if (req.url === "/health") {
      res.writeHead(200, {"Content-Type": "text/plain"});
      res.end("ok");
      return;
    }
    res.writeHead(404, {"Content-Type": "text/plain"});
    res.end("not found");
  });
  server.listen(port);
  console.log("listening on port " + port);
  return server;
}
''',
}
_CODE_EDITS = [
    ("code_rename", "Rename every occurrence of {old} to {new} in the code below. Reply with the complete updated "
                    "code only.", {"stack": ("items", "elements"), "stats": ("values", "data"),
                                   "inventory": ("inventory", "stock"), "server": ("server", "app")}),
    ("code_edit", "Add a docstring (or a comment for JavaScript) to every function in the code below and change "
                  "nothing else. Reply with the complete code.", None),
    ("code_edit", "Add type hints to every function in the code below, keeping the code otherwise identical. Reply "
                  "with the complete code.", None),
]
_TEXT = {
    "meeting": "The team met on Monday to review the quarterly plan. The team agreed that the launch would move "
               "to March. The team also asked the design group to finish the new logo by February. After the "
               "meeting, the team sent a summary to the managers, and the managers approved the new schedule.",
    "recipe": "Preheat the oven to 180 degrees. Mix the flour, the sugar and the butter in a large bowl. Add two "
              "eggs and mix again until the batter is smooth. Pour the batter into a tin and bake for 40 minutes. "
              "Let the cake cool for 10 minutes before you take it out of the tin.",
    "report": "Sales rose by 12 percent in the north region and by 8 percent in the south region. Costs rose by 3 "
              "percent in the north region and by 5 percent in the south region. The north region opened two new "
              "stores, and the south region closed one store. Both regions plan to hire new staff next year.",
    "notice": "Dear residents, the water supply will be turned off on Friday from 9 am to 1 pm for repairs. Please "
              "store enough water before Friday. The repairs will make the water pressure better in every "
              "building. If you have questions, please call the building office. Thank you for your patience.",
}
_TEXT_EDITS = [
    ("text_rewrite", "Rewrite the text below in the past tense where it is in the present tense, and keep every "
                     "other word the same. Reply with the full text."),
    ("text_rewrite", "Copy the text below, replacing every number with the same number written in words. Reply "
                     "with the full text."),
    ("text_format", "Turn the text below into a bulleted list, one sentence per bullet, keeping each sentence's "
                    "words unchanged."),
]


def repetitive_prompts() -> list[dict]:
    """The repetitive set: every (instruction, snippet) pair of the templates above, in a fixed order."""
    rows = []
    for cat, instr, renames in _CODE_EDITS:
        for name, code in _CODE.items():
            text = instr.format(old=renames[name][0], new=renames[name][1]) if renames else instr
            rows.append({"id": f"{cat}-{name}-{len(rows)}", "category": cat, "prompt": f"{text}\n\n{code}"})
    for cat, instr in _TEXT_EDITS:
        for name, text in _TEXT.items():
            rows.append({"id": f"{cat}-{name}-{len(rows)}", "category": cat, "prompt": f"{instr}\n\n{text}"})
    return rows


def write_prompts(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in repetitive_prompts():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(repetitive_prompts())} prompts to {path}")


def load_repetitive(per_category: int | None) -> list[tuple[str, str]]:
    """(category, prompt) of the repetitive set, at most ``per_category`` each."""
    if not REPETITIVE.exists():
        raise FileNotFoundError(f"{REPETITIVE} not found; write it with python -m experiments.bench.suffix "
                                f"--write-prompts {REPETITIVE.relative_to(REPO)}")
    taken: dict[str, int] = defaultdict(int)
    out = []
    for line in REPETITIVE.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if per_category is None or taken[row["category"]] < per_category:
            taken[row["category"]] += 1
            out.append((row["category"], row["prompt"]))
    return out


# ------------------------------------------------------------------------------------------ the run
def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sets", default="spec_bench,repetitive", help="spec_bench, repetitive or both")
    ap.add_argument("--categories", default="all", help="Spec-Bench categories (comma list) or all")
    ap.add_argument("--methods", default="plain,suffix,suffix_tree,ngram,hf,hf_pld")
    ap.add_argument("--k", type=int, default=10, help="suffix chains: up to k tokens")
    ap.add_argument("--tree-depth", type=int, default=10)
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--pld-k", default="3,5,10", help="transformers' prompt_lookup_num_tokens values to run")
    ap.add_argument("--dtype", default="auto", help="our engine's dtype (auto: bf16 where the CPU has bf16 arithmetic)")
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="transformers' dtype for hf and hf_pld (bfloat16: the same values as our bf16 engine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the figures as json here")
    ap.add_argument("--write-prompts", default=None, metavar="PATH", help="write the repetitive set and exit")
    args = ap.parse_args(argv)
    if args.write_prompts:
        write_prompts(Path(args.write_prompts))
        return None
    torch.set_num_threads(args.threads)

    from specdec import LLM, SamplingParams
    from specdec.datamodel.metrics import sum_counts, tau
    from specdec.engine.bench import read_rate_gbs, weight_bytes
    from specdec.engine.loader import resolve_model_dir
    from specdec.experiment.data import load_spec_bench

    methods = args.methods.split(",")
    pld_ks = [int(n) for n in args.pld_k.split(",")]
    prompts: list[tuple[str, str, str]] = []  # (set, category, text)
    for s in args.sets.split(","):
        if s == "spec_bench":
            cats = None if args.categories == "all" else args.categories.split(",")
            prompts += [(s, q.category, q.turns[0]) for q in load_spec_bench(cats, per_category=args.per_category)]
        elif s == "repetitive":
            prompts += [(s, c, p) for c, p in load_repetitive(args.per_category)]
        else:
            raise ValueError(f"--sets: unknown set {s!r}; spec_bench and/or repetitive")

    target = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=4096, dtype=args.dtype)
    nbytes = weight_bytes(target.engine)
    rate0 = read_rate_gbs(nbytes)
    spec_cfgs = {
        "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
        "suffix_tree": {"method": "suffix", "num_speculative_tokens": args.tree_depth, "scorer": "tree",
                        "tree_depth": args.tree_depth, "tree_budget": args.tree_budget},
        "ngram": {"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    }
    llms = {"plain": target.without_speculation()}
    llms.update({m: target.with_speculation(c) for m, c in spec_cfgs.items() if m in methods})
    hf = eos = None
    runs = [m for m in methods if m in llms or m == "hf"]
    if "hf_pld" in methods:
        runs += [f"hf_pld{n}" for n in pld_ks]
    if any(m.startswith("hf") for m in runs):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-135m-instruct"),
                                                  dtype=getattr(torch, args.hf_dtype)).eval()
        eos = target.tokenizer.eos_token_id
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    # per run: one record per prompt (set, category, tokens, seconds, acceptance counts)
    rec: dict[str, list[tuple[str, str, int, float, list[int]]]] = defaultdict(list)
    mismatches: dict[str, int] = defaultdict(int)
    for i, (pset, cat, text) in enumerate(prompts):
        ids = target.chat_prompt_ids([{"role": "user", "content": text}])
        plain_toks = None
        for m in runs:
            t0 = time.perf_counter()
            if m in llms:
                out = llms[m].generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
                toks, counts = out.outputs[0].token_ids, list(out.metrics.spec_token_acceptance_counts or [])
            else:
                extra = {"prompt_lookup_num_tokens": int(m[6:])} if m.startswith("hf_pld") else {}
                with torch.inference_mode():
                    g = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                    pad_token_id=eos, **extra)
                toks, counts = g[0, len(ids):].tolist(), []
            rec[m].append((pset, cat, len(toks), time.perf_counter() - t0, counts))
            if m == "plain":
                plain_toks = toks
            elif m in llms and plain_toks is not None and toks != plain_toks:
                mismatches[m] += 1
        print(f"[{i + 1}/{len(prompts)}] {pset}/{cat}: " + ", ".join(
            f"{m} {rec[m][-1][2] / rec[m][-1][3]:.1f} tok/s" for m in runs), flush=True)
    rate1 = read_rate_gbs(nbytes)

    def rows(m: str, pset: str, cat: str | None):
        return [r for r in rec[m] if r[0] == pset and (cat is None or r[1] == cat)]

    def speedup(m: str, base: str, pset: str, cat: str | None) -> float | None:
        pairs = [(a, b) for a, b in zip(rows(m, pset, cat), rows(base, pset, cat)) if a[2] and b[2]]
        return ratio_of_means([(a[2], a[3]) for a, _ in pairs], [(b[2], b[3]) for _, b in pairs])

    def tps(m: str, pset: str, cat: str | None) -> float:
        sel = rows(m, pset, cat)
        return sum(r[2] for r in sel) / sum(r[3] for r in sel)

    ours = [m for m in runs if m in spec_cfgs]
    plds = [m for m in runs if m.startswith("hf_pld")]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    report: dict = {"read_rate_gbs": [rate0, rate1], "weight_mb": nbytes / 1e6, "args": vars(args),
                    "engine": target.engine.describe(), "torch": torch.__version__, "greedy_mismatches": dict(mismatches),
                    "rows": []}
    print(f"\n# suffix decoding vs prompt lookup: greedy, batch 1, {args.max_tokens} new tokens, "
          f"{args.per_category}/category, suffix k={args.k}, suffix_tree {args.tree_depth}x{args.tree_budget}, "
          f"ngram k=10, hf_pld N in {pld_ks}, transformers in {args.hf_dtype}, {args.threads} threads, torch {torch.__version__}, "
          f"engine {target.engine.describe()}")
    print(f"read rate (W.sum() over {nbytes / 1e6:.0f} MB): {rate0:.1f} GB/s at the start, {rate1:.1f} GB/s at the end")
    cols = ([f"{m} tok/s" for m in runs] + [c for m in ours for c in (f"{m} tau", f"{m} x")]
            + [f"{m} x" for m in plds] + (["best pld x"] if plds else []))
    print(f"{'set/category':<28}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
    for pset in dict.fromkeys(p[0] for p in prompts):
        cats = list(dict.fromkeys(p[1] for p in prompts if p[0] == pset)) + [None]
        for cat in cats:
            row = {"set": pset, "category": cat or "OVERALL"}
            cells = []
            for m in runs:
                row[f"{m}_tokens_per_s"] = tps(m, pset, cat)
                cells.append(f"{row[f'{m}_tokens_per_s']:.2f}")
            for m in ours:
                counts = sum_counts([r[4] for r in rows(m, pset, cat) if r[4]])
                row[f"{m}_tau"] = tau(counts) if counts else None
                row[f"{m}_speedup"] = speedup(m, "plain", pset, cat) if "plain" in runs else None
                cells += [fmt(row[f"{m}_tau"]), fmt(row[f"{m}_speedup"])]
            pld_x = {m: speedup(m, "hf", pset, cat) if "hf" in runs else None for m in plds}
            for m in plds:
                row[f"{m}_speedup"] = pld_x[m]
                cells.append(fmt(pld_x[m]))
            if plds:
                row["best_pld_speedup"] = max((x for x in pld_x.values() if x is not None), default=None)
                cells.append(fmt(row["best_pld_speedup"]))
            report["rows"].append(row)
            print(f"{pset + '/' + (cat or 'OVERALL'):<28}" + "".join(f"{v:>{len(c) + 2}}" for c, v in zip(cols, cells)))
    print(f"greedy mismatches vs our plain decoding: {dict(mismatches) or 0}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
