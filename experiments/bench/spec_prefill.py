"""Does a speculative request's prompt cost more than a plain one's? Time to first token, side by side.

    python -m experiments.bench.spec_prefill [--experiment eagle] [--categories rag,summarization] [--per-category 5]

One process, one target engine: a plain LLM and the experiment's speculative LLM on it (``LLM.with_speculation``),
each prompt answered with ``max_tokens=1`` by one then the other (the order alternating), so the measured time is
the prefill and its first token. Where prompts are long (Spec-Bench's summarization and rag, 450-930 tokens) the
prefill is 35-50% of a request's time, so an extra cost there (an EAGLE head's features of every prompt token) would
cap the speedup before decoding starts.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> dict:
    from experiments.bench.ab import REPO, experiment_spec
    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="eagle")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--categories", default="rag,summarization")
    ap.add_argument("--per-category", type=int, default=5)
    a = ap.parse_args(argv)
    spec = experiment_spec(REPO, a.experiment)
    plain = LLM(a.model, dtype="auto", max_num_seqs=1, max_model_len=4096)
    spec_llm = plain.with_speculation(spec)
    plain_llm = plain.without_speculation()
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    secs = {"plain": [], "spec": []}
    prompts = list(load_spec_bench(a.categories.split(","), per_category=a.per_category))
    for i, q in enumerate(prompts):
        ids = plain.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])
        order = (("plain", plain_llm), ("spec", spec_llm)) if i % 2 == 0 else (("spec", spec_llm), ("plain", plain_llm))
        for name, llm in order:
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
            secs[name].append(time.perf_counter() - t)
        print(f"{q.category} {q.question_id}: {len(ids)} tokens  plain {1e3 * secs['plain'][-1]:.1f} ms  "
              f"speculative {1e3 * secs['spec'][-1]:.1f} ms")
    res = {"prompts": len(prompts), "plain_ms": 1e3 * sum(secs["plain"]), "spec_ms": 1e3 * sum(secs["spec"])}
    res["ratio"] = res["spec_ms"] / res["plain_ms"] if res["plain_ms"] else float("nan")
    print(f"{res['prompts']} prompts: plain {res['plain_ms']:.0f} ms, speculative {res['spec_ms']:.0f} ms, "
          f"speculative / plain {res['ratio']:.3f}")
    return res


if __name__ == "__main__":
    main()
