"""Speculative decoding vs plain decoding over Spec-Bench, ours and transformers', in one run.

    python -m experiments.bench.spec [--per-category 5] [--max-new-tokens 128] [--k 4] [--ngram-k 10]
                                     [--hf-pld-k 10] [--dtype float32] [--threads 2]
                                     [--methods plain,ngram,layer_skip,hf,hf_pld]

Greedy, batch 1, the first turn of each question with the chat template. Every method runs on one
prompt before the next prompt starts (interleaved), so machine noise hits all methods alike. Prints per
category and overall: tau, tokens/s and speedup over plain decoding (Spec-Bench's speedup: the mean of
per-question tokens/s ratios), transformers' prompt-lookup speedup over its own plain `generate`, the
framework overhead (wall time outside model forwards, share of the run), the measured v (target cost of
k+1 tokens / 1 token) and c (draft cost per token / target cost of 1 token), and the efficiency =
speedup / (tau / (v + k*c)).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

FWD = {"t": 0.0}  # seconds spent inside NativeEngine.forward (target and draft), over the whole run


def instrument_forward() -> None:
    from specdec.engine.native import NativeEngine

    real = NativeEngine.forward

    def timed(self, batch):
        t = time.perf_counter()
        try:
            return real(self, batch)
        finally:
            FWD["t"] += time.perf_counter() - t

    NativeEngine.forward = timed


def forward_cost(engine, n_tokens: int, context: int, reps: int = 7) -> float:
    """Median seconds of one forward of ``n_tokens`` new tokens after ``context`` cached ones."""
    from specdec.engine import ForwardBatch

    slot = engine.allocate_slot()
    try:
        engine.forward(ForwardBatch(token_ids=torch.arange(context) % 1000 + 10, slots=[slot], query_lens=[context],
                                    logits_indices=torch.tensor([context - 1])))
        times = []
        for _ in range(reps):
            engine.rollback(slot, context)
            t = time.perf_counter()
            engine.forward(ForwardBatch(token_ids=torch.arange(n_tokens) + 20, slots=[slot], query_lens=[n_tokens]))
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        engine.free_slot(slot)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="k of the draft-model methods (layer_skip)")
    ap.add_argument("--ngram-k", type=int, default=10, help="n-gram drafts up to this many tokens")
    ap.add_argument("--hf-pld-k", type=int, default=10, help="transformers' prompt_lookup_num_tokens (its default: 10)")
    ap.add_argument("--dtype", default="float32", help="our engine's dtype (transformers runs float32)")
    ap.add_argument("--layer-skip-layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="plain,ngram,layer_skip,hf,hf_pld")
    ap.add_argument("--categories", default="all", help="comma list of Spec-Bench categories, or all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    instrument_forward()

    from transformers import AutoModelForCausalLM

    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench
    from specdec.engine.loader import resolve_model_dir
    from specdec.datamodel.metrics import sum_counts, tau

    methods = args.methods.split(",")
    k = args.k
    target = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=4096, dtype=args.dtype)
    spec_cfgs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.ngram_k, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 1},
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": k, "num_layers": args.layer_skip_layers},
    }
    llms = {"plain": target.without_speculation()}
    llms.update({m: target.with_speculation(c) for m, c in spec_cfgs.items() if m in methods})
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-135m-instruct"), dtype=torch.float32).eval()
    eos = target.tokenizer.eos_token_id
    cats_arg = None if args.categories == "all" else args.categories.split(",")
    qs = load_spec_bench(cats_arg, per_category=args.per_category)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)

    # per method: per question (category, tokens, seconds, forward seconds, counts)
    rec: dict[str, list[tuple[str, int, float, float, list[int]]]] = defaultdict(list)
    mismatches = 0
    for i, q in enumerate(qs):
        ids = target.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])
        plain_toks = None
        for m in methods:
            f0 = FWD["t"]
            t0 = time.perf_counter()
            if m in llms:
                out = llms[m].generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
                toks = out.outputs[0].token_ids
                counts = list(out.metrics.spec_token_acceptance_counts or [])
            else:
                extra = {"prompt_lookup_num_tokens": args.hf_pld_k} if m == "hf_pld" else {}
                with torch.inference_mode():
                    g = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                    pad_token_id=eos, **extra)
                toks, counts = g[0, len(ids):].tolist(), []
            dt = time.perf_counter() - t0
            rec[m].append((q.category, len(toks), dt, FWD["t"] - f0, counts))
            if m == "plain":
                plain_toks = toks
            elif m in llms and plain_toks is not None and toks != plain_toks:
                mismatches += 1
        print(f"[{i + 1}/{len(qs)}] {q.category}: " + ", ".join(
            f"{m} {rec[m][-1][1] / rec[m][-1][2]:.1f} tok/s" for m in methods), flush=True)

    # v and c at a typical context length
    ctx = 512
    t1 = forward_cost(target.engine, 1, ctx)
    ks = {"ngram": args.ngram_k, "layer_skip": k}
    vs = {m: forward_cost(target.engine, ks[m] + 1, ctx) / t1 for m in spec_cfgs}
    cs = {"ngram": 0.0}
    if "layer_skip" in llms:
        draft = llms["layer_skip"].worker.top1.proposer.engine
        cs["layer_skip"] = forward_cost(draft, 1, ctx) / t1

    def speedup(m: str, base: str, cat: str | None) -> float:
        pairs = [(a, b) for a, b in zip(rec[m], rec[base]) if cat is None or a[0] == cat]
        return statistics.mean((a[1] / a[2]) / (b[1] / b[2]) for a, b in pairs if a[1] and b[1])

    cats = list(dict.fromkeys(q.category for q in qs)) + [None]
    print(f"\n# Spec-Bench, {args.per_category}/category, {args.max_new_tokens} new tokens, greedy, batch 1, "
          f"k={k}, ngram k={args.ngram_k}, hf_pld k={args.hf_pld_k}, {args.threads} threads, torch {torch.__version__}, "
          f"engine {target.engine.describe()}")
    header = "category        " + " ".join(f"{m + ' tok/s':>17}" for m in methods)
    spec_methods = [m for m in methods if m in spec_cfgs]
    header += "".join(f" {m + ' tau':>13} {m + ' x':>12}" for m in spec_methods)
    if "hf" in methods and "hf_pld" in methods:
        header += f" {'hf_pld x':>9}"
    print(header)
    for cat in cats:
        row = f"{cat or 'OVERALL':<15} "
        for m in methods:
            sel = [r for r in rec[m] if cat is None or r[0] == cat]
            row += f"{sum(r[1] for r in sel) / sum(r[2] for r in sel):>17.2f} "
        for m in spec_methods:
            counts = sum_counts([r[4] for r in rec[m] if (cat is None or r[0] == cat) and r[4]])
            row += f"{tau(counts):>13.3f} {speedup(m, 'plain', cat):>12.3f}"
        if "hf" in methods and "hf_pld" in methods:
            row += f" {speedup('hf_pld', 'hf', None if cat is None else cat):>9.3f}"
        print(row)
    print(f"\n1-token target forward = {t1 * 1e3:.1f} ms (context {ctx})")
    for m in spec_methods:
        counts = sum_counts([r[4] for r in rec[m] if r[4]])
        t_all = tau(counts)
        v = vs[m]
        print(f"{m}: v(k+1={ks[m] + 1}) = {v:.3f} (full-length proposals; shorter ones cost less)")
        ideal = t_all / (v + ks[m] * cs[m])
        sp_m = speedup(m, "plain", None)
        wall = sum(r[2] for r in rec[m])
        fwd = sum(r[3] for r in rec[m])
        print(f"{m}: tau={t_all:.3f} c={cs[m]:.3f} predicted speedup tau/(v+k*c)={ideal:.3f} measured={sp_m:.3f} "
              f"efficiency={sp_m / ideal:.3f} overhead outside model forwards={(wall - fwd) / wall:.1%}")
    wall, fwd = sum(r[2] for r in rec["plain"]), sum(r[3] for r in rec["plain"])
    print(f"plain: overhead outside model forwards={(wall - fwd) / wall:.1%}")
    print(f"greedy mismatches vs plain: {mismatches}")


if __name__ == "__main__":
    main()
