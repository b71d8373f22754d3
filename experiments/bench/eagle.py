"""EAGLE family side by side with plain decoding, in one run: tau, tokens/s, speedup, v and c.

    python -m experiments.bench.eagle [--categories mt_bench] [--per-category 1] [--max-new-tokens 128]
                                      [--configs eagle_chain4,eagle_tree5x4x16,eagle3_chain4,...]

Greedy, batch 1, first turns with the chat template. For every prompt, plain decoding and then each
config run back to back (interleaved, so machine noise hits all alike); greedy outputs are checked
against plain. Per config: tau, tokens/s, speedup (mean of per-question tokens/s ratios, Spec-Bench's
definition), greedy mismatches, mean propose / score time per step, and the speedup model of DESIGN.md:
v = score time per step / plain time per token, c = propose time per step / depth / plain time per token,
predicted = tau / (v + depth * c).

Config names: ``{eagle|eagle3}_chain{k}`` or ``{eagle|eagle3}_tree{depth}x{topk}x{budget}``, and
``medusa_chain{k}`` for the Medusa heads.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch


def spec_config(name: str) -> dict:
    m = re.fullmatch(r"(eagle3|eagle|medusa)_(chain(\d+)|tree(\d+)x(\d+)x(\d+))", name)
    if m is None:
        raise SystemExit(f"bench_eagle: config {name!r}; use e.g. eagle_chain4, eagle3_tree5x4x16, medusa_chain3")
    method = m.group(1)
    opts = {"draft_vocab_size": 2048} if method == "eagle" else {}
    if m.group(3):
        return {"method": method, "num_speculative_tokens": int(m.group(3)), "options": opts}
    d, k, b = (int(m.group(i)) for i in (4, 5, 6))
    return {"method": method, "num_speculative_tokens": d, "scorer": "tree", "tree_depth": d, "tree_topk": k,
            "tree_budget": b, "options": opts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--categories", default="mt_bench")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="eagle_chain4,eagle_tree5x4x16,eagle_tree4x3x8,eagle_tree3x2x4,"
                                         "eagle3_chain4,eagle3_tree5x4x16,eagle3_tree4x3x8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench

    cats = args.categories if args.categories in ("all", "mt_bench") else args.categories.split(",")
    qs = load_spec_bench(cats, per_category=args.per_category)
    llm = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=4096)
    prompts = [{"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])} for q in qs]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    names = args.configs.split(",")
    runners = {"plain": llm.without_speculation()}
    runners.update({n: llm.with_speculation(spec_config(n)) for n in names})
    for r in runners.values():  # warm-up, then clean metrics
        r.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        r.reset_metrics()

    speed = {n: [] for n in runners}  # per prompt tokens/s
    toks = {n: 0 for n in runners}
    secs = {n: 0.0 for n in runners}
    mism = {n: 0 for n in names}
    for i, p in enumerate(prompts):
        ref = None
        for n, r in runners.items():
            t0 = time.perf_counter()
            out = r.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
            dt = time.perf_counter() - t0
            speed[n].append(len(out) / dt)
            toks[n] += len(out)
            secs[n] += dt
            if n == "plain":
                ref = out
            else:
                mism[n] += out != ref
        print(f"[{i + 1}/{len(prompts)}] {qs[i].category}: "
              + ", ".join(f"{n} {speed[n][-1]:.1f}" for n in runners), flush=True)

    per_tok = secs["plain"] / toks["plain"]
    print(f"\n# {len(prompts)} prompts ({args.categories}), {args.max_new_tokens} new tokens, greedy, batch 1, "
          f"{args.threads} threads; plain {toks['plain'] / secs['plain']:.2f} tok/s ({1000 * per_tok:.1f} ms/token)")
    print(f"{'config':<20} {'tau':>5} {'tok/s':>6} {'speedup':>7} {'mism':>4} {'propose ms':>10} {'score ms':>8} "
          f"{'v':>5} {'c':>6} {'pred':>5}")
    for n in names:
        m = runners[n].get_metrics()
        cfg = spec_config(n)
        depth = cfg["num_speculative_tokens"]
        st = m.mean_step_time_s
        v = st.get("score", 0.0) / per_tok
        c = st.get("propose", 0.0) / depth / per_tok
        tau = m.mean_acceptance_length
        sp_ = statistics.mean(a / b for a, b in zip(speed[n], speed["plain"]))
        print(f"{n:<20} {tau:>5.2f} {toks[n] / secs[n]:>6.2f} {sp_:>7.3f} {mism[n]:>4} "
              f"{1000 * st.get('propose', 0):>10.1f} {1000 * st.get('score', 0):>8.1f} {v:>5.2f} {c:>6.3f} "
              f"{tau / (v + depth * c):>5.2f}")


if __name__ == "__main__":
    main()
