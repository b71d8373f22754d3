"""Greedy equality, plain vs every proposer, in fp32 and bf16, on Spec-Bench first turns (issue #19).

    python -m experiments.bench.greedy_matrix [--dtypes float32,bfloat16] [--per-category 2] [--max-new-tokens 64]

For each dtype one target is loaded; its plain greedy output is the reference, and each speculative
configuration (sharing the target's engine) must reproduce it token for token. Prompts run 4 at a time,
so rows are verified among other sequences, as in serving. Prints mismatches (with the first differing
position) and tau per configuration. The CI test tests/spec_decode/test_greedy_matrix_smollm2.py is the
short version.
"""

from __future__ import annotations

import argparse
import time

CONFIGS = {
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram k=10": {"method": "ngram", "num_speculative_tokens": 10},
    "draft_model k=3": {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 3},
    "layer_skip 8 k=3": {"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3},
    "eagle chain k=4": {"method": "eagle", "num_speculative_tokens": 4, "options": {"draft_vocab_size": 2048}},
    "eagle tree 4x4x12": {"method": "eagle", "num_speculative_tokens": 4, "options": {"draft_vocab_size": 2048},
                          "scorer": "tree", "tree_depth": 4, "tree_topk": 4, "tree_budget": 12},
    "medusa k=3": {"method": "medusa", "num_speculative_tokens": 3},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()

    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench

    qs = load_spec_bench(None, per_category=args.per_category)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    for dt in args.dtypes.split(","):
        target = LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=2048, dtype=dt)
        prompts = [{"prompt_token_ids": target.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])} for q in qs]
        ref = [o.outputs[0].token_ids for o in target.generate(prompts, sp, use_tqdm=False)]
        print(f"# dtype={dt} engine={target.engine.describe()} prompts={len(prompts)} max_new_tokens={args.max_new_tokens}")
        for name in args.configs.split(","):
            t = time.perf_counter()
            llm = target.with_speculation(CONFIGS[name])
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            bad = [(i, next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r))))
                   for i, (g, r) in enumerate(zip(got, ref)) if g != r]
            m = llm.get_metrics()
            print(f"{dt:>9} {name:<20} mismatches {len(bad):2d}/{len(prompts)} "
                  f"{'first at ' + str(bad[:3]) if bad else '':<28} tau {m.mean_acceptance_length:.2f} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
