"""A second prompt pool the target writes itself from nothing: Magpie (Xu et al. 2024, "Alignment data
synthesis from scratch by prompting aligned LLMs with nothing").

An instruct model fed only its chat template's pre-query part (system prompt, then ``<|im_start|>user\\n``)
samples a user turn from what it learned of its chat data. SmolLM2-135M-Instruct writes natural, varied
requests this way (advice, code, travel, e-mails, maths, ...), far nearer to MT-bench's chat than the
template x topic prompts of build_prompts.py, whose categories the heads draft worst (experiments/LOG.md,
2026-11-27 midday). The system prompt is the template's default, as ``specdec.experiment.run`` uses it.

    python -m experiments.distill.magpie --out data/distill/magpie --requests 4096 --threads 2
    python -m experiments.train.gen_distill_data pool=data/distill/magpie out=~/.cache/specdec/distill/magpie-gen ...
    python -m experiments.distill.magpie --out data/distill/magpie2 --seed 1 --requests 6144 --threads 2 \
        --pool data/distill --pool data/distill/magpie      # a second pool, disjoint from both

Sampling: T = 1.0, top-p 0.95, one seed per request, up to ``--max-tokens`` tokens. Kept: turns the target
ended itself (``<|im_end|>``), 3-250 words, mostly letters, no template tokens; then MinHash near-dup
(dedup.py, Jaccard 0.7) against each other and every ``--pool``'s prompts (the main pool's by default).
Decontamination: a turn within Jaccard 0.5 of any Spec-Bench turn (which includes MT-bench) is dropped, and an
exact match too; the benchmark's text is read for that filter only.

Writes ``<out>/prompts.jsonl.gz`` and ``<out>/prompts.npz`` in build_prompts.py's format (category
``magpie``; temperatures alternate 0 / 0.7 by rank, seeds ``10,000,000 * (seed + 1000) + i`` so that
they differ from the main pool's) and ``<out>/pool_stats.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import time
from pathlib import Path

from experiments.distill.build_prompts import stats, tokenize, write_pool
from experiments.distill.dedup import MinHashDeduper

SEED_OFFSET = 1000  # pool seeds 10M * (seed + 1000) + i: never a main-pool seed
_TEMPLATE = re.compile(r"<\|im_(start|end)\|>|<\|endoftext\|>")


def pre_query_ids(tok) -> list[int]:
    """The chat template's ids up to where the first user turn's text starts (system prompt included)."""
    marker = "\x00MAGPIE\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    if marker not in text:
        raise ValueError("magpie: the chat template does not place the user's text verbatim; cannot cut it")
    return tok(text.split(marker)[0], add_special_tokens=False)["input_ids"]


def clean(text: str, finish: str) -> str | None:
    """The user turn, or None if it fails the filters."""
    t = text.strip()
    words = t.split()
    if finish != "stop" or not 3 <= len(words) <= 250 or _TEMPLATE.search(t):
        return None
    letters = sum(c.isalpha() for c in t)
    if letters < 0.5 * len(t.replace(" ", "")):
        return None
    return t


def benchmark_turns() -> list[str]:
    from specdec.experiment.data import spec_bench_path

    path = spec_bench_path()
    return [t.strip() for x in path.read_text().splitlines() if x.strip() for t in json.loads(x)["turns"]]


def pool_texts(pool: Path) -> list[str]:
    if not (pool / "prompts.jsonl.gz").is_file():
        return []
    with gzip.open(pool / "prompts.jsonl.gz", "rt") as f:
        return ["\n".join(m["content"] for m in json.loads(x)["messages"]) for x in f if x.strip()]


def magpie(llm, tok, n_requests: int, existing: list[str], bench: list[str], *, seed: int = 0,
           max_tokens: int = 160, chunk: int = 512, temperature: float = 1.0, top_p: float = 0.95) -> tuple[list[str], dict]:
    """``n_requests`` sampled user turns; returns (the turns kept, in order, and the filter counts)."""
    from specdec import SamplingParams

    pre = pre_query_ids(tok)
    dd = MinHashDeduper(0.7, seed)
    for t in existing:
        dd.add(t)
    contam = MinHashDeduper(0.5, seed)
    for t in bench:
        contam.add(t)
    exact = set(bench)
    kept: list[str] = []
    counts = {"requests": 0, "unfinished_or_filtered": 0, "benchmark_near": 0, "near_duplicate": 0}
    t0 = time.time()
    for start in range(0, n_requests, chunk):
        n = min(chunk, n_requests - start)
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed * 1_000_003 + start + i,
                                 max_tokens=max_tokens, stop=["<|im_end|>"]) for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": pre}] * n, params)
        for o in outs:
            counts["requests"] += 1
            c = o.outputs[0]
            t = clean(c.text, c.finish_reason)
            if t is None:
                counts["unfinished_or_filtered"] += 1
            elif t in exact or contam.near(t):
                counts["benchmark_near"] += 1
            elif not dd.add(t):
                counts["near_duplicate"] += 1
            else:
                kept.append(t)
        print(f"magpie: {len(kept)} kept of {start + n} requests ({time.time() - t0:.0f} s)", flush=True)
    return kept, counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="data/distill/magpie")
    ap.add_argument("--pool", action="append", default=None,
                    help="a pool the turns are de-duplicated against; repeatable (default: the main pool "
                    "data/distill; add data/distill/magpie for a second Magpie pool)")
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    from specdec import LLM
    from specdec.engine.loader import load_tokenizer

    out = Path(args.out)
    if any((out / "responses").glob("shard_*.npz")):
        raise SystemExit(f"magpie: {out} already has responses; a rebuild would renumber the prompts they answer. "
                         "Write new turns to another directory (--out ... --seed N) and train on both")
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(args.model)
    llm = LLM(args.model, max_num_seqs=args.batch, max_model_len=512, dtype=args.dtype, num_threads=args.threads)
    existing = [t for p in (args.pool or ["data/distill"]) for t in pool_texts(Path(p))]
    turns, counts = magpie(llm, tok, args.requests, existing, benchmark_turns(), seed=args.seed,
                           max_tokens=args.max_tokens)
    items = [{"category": "magpie", "source": "magpie_target", "messages": [{"role": "user", "content": t}],
              "licence": "written by the target (SmolLM2-135M-Instruct, Apache-2.0) from its chat template alone"}
             for t in turns]
    items, ids = tokenize(items, args.model, args.max_prompt_tokens)
    if not items:
        raise SystemExit(f"magpie: none of {args.requests} requests gave a usable user turn ({counts}); a base or "
                         "random model does not end its turns: use an instruct model, or raise --requests")
    write_pool(out, items, ids, args.seed + SEED_OFFSET)
    st = stats(items, ids) | {"magpie": counts | {"kept": len(items)}, "model": args.model, "dtype": args.dtype}
    (out / "pool_stats.json").write_text(json.dumps(st, indent=1) + "\n")
    print(json.dumps(st, indent=1))
    return st


if __name__ == "__main__":
    main()
