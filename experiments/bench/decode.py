"""Plain greedy decoding: specdec's native engine vs transformers' `generate`, same weights, one run.

    python -m experiments.bench.decode [--prompts 10] [--max-new-tokens 128] [--threads 2]

10 Spec-Bench prompts (one per category, chat template applied), 128 new tokens each (EOS ignored in
both so the token counts are equal), at batch 1 and then batch 8. Prints tokens/s for both and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch


def hf_generate(model, prompts: list[list[int]], max_new: int, batch: int, pad_id: int) -> tuple[int, float]:
    toks = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad_id)
        toks += (out.shape[1] - width) * len(chunk)
    return toks, time.perf_counter() - t0


def ours_generate(llm, prompts: list[list[int]], max_new: int) -> tuple[int, float, list[list[int]]]:
    from specdec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), dt, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from specdec import LLM
    from specdec.experiment.data import load_spec_bench
    from specdec.engine.loader import resolve_model_dir

    qs = load_spec_bench()[: args.prompts]  # file order: one per category first
    batches = [int(b) for b in args.batches.split(",")]
    llms = {b: LLM(args.model, max_num_seqs=b, max_model_len=1024) for b in batches}
    tok = llms[batches[0]].tokenizer
    prompts = [llms[batches[0]].chat_prompt_ids([{"role": "user", "content": q.turns[0]}]) for q in qs]
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    print(f"# {len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"torch {torch.__version__}, fp32")
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}")
    for b in batches:
        ours_generate(llms[b], prompts[:1], 8)  # warm-up
        with torch.inference_mode():
            hf_generate(hf, prompts[:1], 8, 1, pad)
            n_hf, t_hf = hf_generate(hf, prompts, args.max_new_tokens, b, pad)
        n_us, t_us, _ = ours_generate(llms[b], prompts, args.max_new_tokens)
        print(f"{b:>5} {n_us / t_us:>11.2f} {n_hf / t_hf:>9.2f} {(n_us / t_us) / (n_hf / t_hf):>6.2f}")


if __name__ == "__main__":
    main()
