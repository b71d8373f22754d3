"""Is ``specdec.experiment.run``'s in-run baseline an honest plain decoder? One process times, interleaved per prompt, a
plain ``LLM`` of its own, the in-run baseline (``without_speculation()`` of the speculative ``LLM``: the same
engine, what ``specdec.experiment.run`` divides by) and the speculative ``LLM``, on the same prompts.

    python -m experiments.bench.baseline --experiment eagle --prompts-per-category 1

Greedy, batch 1, the chat template, MT-bench first turns, fp32. Prints tokens/s of each (the sum of tokens over
the sum of seconds) and the speculative one's ratio to both plain ones.
"""

from __future__ import annotations

import argparse
import json
import time

from experiments.bench.ab import REPO, experiment_spec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="eagle", help="a conf/experiment name with a tree proposer")
    ap.add_argument("--prompts-per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)
    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench

    prompts = load_spec_bench("mt_bench", args.prompts_per_category)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    plain = LLM(args.model, max_num_seqs=1, max_model_len=4096)
    spec = LLM(args.model, max_num_seqs=1, max_model_len=4096, speculative_config=experiment_spec(REPO, args.experiment))
    runs = {"plain": plain, "in_run_baseline": spec.without_speculation(), "speculative": spec}
    ids = [plain.chat_prompt_ids([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    for m in runs.values():  # one-off costs out of the figures
        m.generate([{"prompt_token_ids": ids[0][:32]}], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    secs, toks = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0)
    for x in ids:
        for name, m in runs.items():
            t = time.perf_counter()
            out = m.generate([{"prompt_token_ids": x}], sp, use_tqdm=False)[0]
            secs[name] += time.perf_counter() - t
            toks[name] += len(out.outputs[0].token_ids)
    tps = {k: toks[k] / secs[k] for k in runs}
    res = {"experiment": args.experiment, "prompts": len(ids), "tokens_per_s": tps,
           "speculative_over_plain": tps["speculative"] / tps["plain"],
           "speculative_over_in_run_baseline": tps["speculative"] / tps["in_run_baseline"],
           "same_plain_tokens": toks["plain"] == toks["in_run_baseline"]}
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
