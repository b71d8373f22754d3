"""Build the distillation prompt pool (issue #13): >= 20k chat prompts from legitimate sources, near-dup
filtered, ordered so that any prefix is a balanced mix, each with its sampling plan (temperature, seed).

    python -m experiments.distill.build_prompts --out data/distill            # ~25 min on 2 cores
    python -m experiments.distill.build_prompts --model tiny-random-llama --out /tmp/p --small   # seconds

Sources (see data/distill/CARD.md, written by this script): GSM8K train and the Self-Instruct seed tasks
(../shared/data), prompts the target writes itself from the seeds (self_instruct.py; cached in
``<out>/self_instruct_target.jsonl`` so a rebuild does not re-run the target), template prompts
(templates.py), prompts quoting permissively licensed package docs and code (docs.py), and two-turn
conversations whose first answer is a reference answer shipped with GSM8K / Self-Instruct.
Spec-Bench and benchmark test splits are never read.

Writes ``<out>/prompts.jsonl.gz`` (id, category, source, licence, temperature, seed, messages) and
``<out>/prompts.npz`` (the chat-templated prompt token ids exactly as ``specdec.experiment.run`` builds them:
``tokens`` flat, ``offsets`` [N+1], ``temperature`` [N], ``seed`` [N]). Deterministic for a given seed,
installed package versions and (for the self-instruct part) engine dtype.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np

from experiments.distill.dedup import MinHashDeduper
from experiments.distill.docs import doc_prompts
from experiments.distill.templates import template_prompts

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TEMPERATURES = (0.0, 0.7)  # alternating by rank: every prefix of the pool has both halves

# Template / doc prompts per category (before de-dup). The two dicts together with GSM8K (7,473), the
# seeds (175), the target's own tasks and the multi-turn items make the >= 20k pool.
TEMPLATE_COUNTS = {"writing": 1500, "roleplay": 1200, "stem": 1200, "humanities": 1200, "qa": 1000,
                   "coding": 800, "reasoning": 280, "extraction": 160, "translation": 600}
DOC_COUNTS = {"coding": 3000, "extraction": 1200, "summarization": 1500, "rag": 1800, "translation": 600}
# Share of each category in any prefix of the ordered pool (while it lasts): MT-bench / Spec-Bench-like
# chat is what the heads must draft, so GSM8K (30% of the pool) is not allowed to dominate the first tokens.
SHARES = {"math": 14, "coding": 12, "writing": 8, "roleplay": 7, "reasoning": 3, "stem": 8, "humanities": 8,
          "qa": 6, "extraction": 7, "summarization": 7, "translation": 5, "rag": 8, "self_instruct": 3,
          "multi_turn": 4}
FOLLOW_UPS = [
    "Can you explain that more simply?", "Now check the answer step by step. Is it right?",
    "Summarize your answer in one sentence.", "Can you give another example like this one?",
    "Rewrite the answer as a short poem.", "What would change if all the numbers were doubled?",
    "Explain the same thing to a ten-year-old.", "Write a similar question with a different story, and solve it.",
    "Make the answer more formal.", "What is a common mistake people make with this kind of problem?",
]
LICENCES = {"gsm8k": "MIT (GSM8K train split, ../shared/data)",
            "self_instruct_seed": "Apache-2.0 (Self-Instruct seed tasks, ../shared/data)",
            "self_instruct_target": "written by the target (SmolLM2-135M-Instruct, Apache-2.0) from the seeds",
            "template": "written for this project"}


def load_shared(data: Path) -> tuple[list[dict], list[dict]]:
    gsm = [json.loads(x) for x in (data / "gsm8k_train.jsonl").read_text().splitlines() if x.strip()]
    seeds = [json.loads(x) for x in (data / "self_instruct_seed_tasks.jsonl").read_text().splitlines() if x.strip()]
    return gsm, seeds


def _seed_text(row: dict) -> str:
    inp = row["instances"][0]["input"] if row["instances"] else ""
    return row["instruction"] + ("\n\n" + inp if inp else "")


def _gsm_answer(ans: str) -> str:
    ans = re.sub(r"<<[^>]*>>", "", ans)
    return re.sub(r"\n?#### *(.+)$", r"\nThe answer is \1.", ans.strip())


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def multi_turn(gsm: list[dict], seeds: list[dict], n_gsm: int, rng: random.Random) -> list[dict]:
    """Two-turn conversations: a reference answer shipped with the data as the first assistant turn, then
    a follow-up the target answers (the second turn MT-bench asks for)."""
    out = []
    for row in rng.sample(gsm, n_gsm):
        out.append({"category": "multi_turn", "source": "gsm8k", "messages": user(row["question"]) + [
            {"role": "assistant", "content": _gsm_answer(row["answer"])}] + user(rng.choice(FOLLOW_UPS))})
    for row in seeds:
        if row["instances"] and row["instances"][0]["output"].strip():
            out.append({"category": "multi_turn", "source": "self_instruct_seed", "messages": user(_seed_text(row)) + [
                {"role": "assistant", "content": row["instances"][0]["output"].strip()}] + user(rng.choice(FOLLOW_UPS[2:]))})
    return out


def target_tasks(args, seeds: list[str], existing: list[str]) -> list[str]:
    cache = Path(args.out) / "self_instruct_target.jsonl"
    if cache.exists() and not args.regenerate_self_instruct:
        return [json.loads(x)["task"] for x in cache.read_text().splitlines() if x.strip()]
    if args.self_instruct_requests <= 0:
        return []
    from experiments.distill.self_instruct import self_instruct
    from specdec import LLM

    llm = LLM(args.model, max_num_seqs=args.batch, max_model_len=512, dtype=args.dtype, num_threads=args.threads)
    tasks = self_instruct(llm, seeds, existing, args.self_instruct_requests, seed=args.seed)
    cache.write_text("".join(json.dumps({"task": t}) + "\n" for t in tasks))
    return tasks


def ordered(items: list[dict], seed: int) -> list[dict]:
    """Weighted random order (Efraimidis-Spirakis keys u^(1/w)): a prefix holds each category in
    proportion to SHARES until the category runs out."""
    rng = random.Random(seed)
    n_cat = Counter(it["category"] for it in items)
    keys = [math.log(rng.random()) * n_cat[it["category"]] / SHARES[it["category"]] for it in items]
    return [items[i] for i in sorted(range(len(items)), key=lambda i: -keys[i])]


def build(args) -> list[dict]:
    rng = random.Random(args.seed)
    gsm, seeds = load_shared(Path(args.data))
    small = 0.01 if args.small else 1.0
    n = lambda x: max(1, int(x * small))  # noqa: E731
    items: list[dict] = []
    items += [{"category": "math", "source": "gsm8k", "messages": user(r["question"])} for r in gsm[: n(len(gsm))]]
    items += [{"category": "self_instruct", "source": "self_instruct_seed", "messages": user(_seed_text(r))}
              for r in seeds[: n(len(seeds))]]
    items += multi_turn(gsm, seeds[: n(len(seeds))], n(600), rng)
    items += [{"category": c, "source": "template", "messages": user(t)}
              for c, t in template_prompts({k: n(v) for k, v in TEMPLATE_COUNTS.items()}, args.seed)]
    t0 = time.time()
    items += [{"category": c, "source": s, "licence": lic, "messages": user(t)}
              for c, t, s, lic in doc_prompts({k: n(v) for k, v in DOC_COUNTS.items()}, args.seed, args.small)]
    print(f"package docs read in {time.time() - t0:.0f} s", flush=True)
    seed_texts = [r["instruction"] for r in seeds]
    tasks = target_tasks(args, seed_texts, [it["messages"][0]["content"] for it in items])
    items += [{"category": "self_instruct", "source": "self_instruct_target", "messages": user(t)} for t in tasks]
    # de-dup over whole conversations, in the order above (shared data wins over what is built from it)
    dd = MinHashDeduper(args.dedup_threshold, args.seed)
    kept = [it for it in items if dd.add("\n".join(m["content"] for m in it["messages"]))]
    print(f"de-dup: {len(items)} -> {len(kept)}", flush=True)
    for it in kept:
        it.setdefault("licence", LICENCES.get(it["source"], ""))
    return kept


def tokenize(items: list[dict], model: str, max_prompt_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """Chat-templated token ids, as specdec.experiment.run (LLM.chat_prompt_ids) builds them; too long prompts dropped."""
    from specdec.engine.loader import load_tokenizer

    tok = load_tokenizer(model)
    keep, ids = [], []
    for it in items:
        text = tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False)
        x = tok(text, add_special_tokens=False)["input_ids"]
        if len(x) <= max_prompt_tokens:
            keep.append(it)
            ids.append(x)
    return keep, ids


def write_pool(out: Path, items: list[dict], ids: list[list[int]], seed: int) -> None:
    for i, it in enumerate(items):
        it["id"] = i
        it["temperature"] = TEMPERATURES[i % len(TEMPERATURES)]
        it["seed"] = seed * 10_000_000 + i
    with gzip.open(out / "prompts.jsonl.gz", "wt", compresslevel=9) as f:  # mtime in the header: see CARD
        for it in items:
            f.write(json.dumps({k: it[k] for k in ("id", "category", "source", "licence", "temperature", "seed",
                                                   "messages")}, ensure_ascii=False) + "\n")
    vmax = max(max(x) for x in ids)
    np.savez_compressed(out / "prompts.npz", tokens=np.array([t for x in ids for t in x],
                        dtype=np.uint16 if vmax < 65536 else np.int32),
                        offsets=np.cumsum([0] + [len(x) for x in ids]).astype(np.int64),
                        temperature=np.array([it["temperature"] for it in items], dtype=np.float32),
                        seed=np.array([it["seed"] for it in items], dtype=np.int64))


def stats(items: list[dict], ids: list[list[int]]) -> dict:
    by_cat = Counter(it["category"] for it in items)
    by_src = Counter(it["source"] for it in items)
    toks = Counter()
    for it, x in zip(items, ids):
        toks[it["category"]] += len(x)
    first = Counter(it["category"] for it in items[:10_000])
    return {"num_prompts": len(items), "prompt_tokens": sum(map(len, ids)), "by_category": dict(by_cat.most_common()),
            "by_source": dict(by_src.most_common()), "prompt_tokens_by_category": dict(toks.most_common()),
            "first_10k_by_category": dict(first.most_common()),
            "licences": dict(Counter(it["licence"] for it in items).most_common())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="data/distill")
    ap.add_argument("--data", default=str(DATA), help="the shared data dir (gsm8k_train.jsonl, self_instruct_seed_tasks.jsonl)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are dropped")
    ap.add_argument("--dedup-threshold", type=float, default=0.7, help="MinHash Jaccard at which a text is dropped")
    ap.add_argument("--self-instruct-requests", type=int, default=512, help="target generations asked for")
    ap.add_argument("--regenerate-self-instruct", action="store_true", help="ignore <out>/self_instruct_target.jsonl")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--small", action="store_true", help="1%% of every source (smoke tests)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    items, ids = tokenize(ordered(build(args), args.seed), args.model, args.max_prompt_tokens)
    write_pool(out, items, ids, args.seed)
    st = stats(items, ids)
    (out / "pool_stats.json").write_text(json.dumps(st, indent=1) + "\n")
    print(json.dumps(st, indent=1))


if __name__ == "__main__":
    main()
