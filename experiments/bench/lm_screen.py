"""How many candidates an exact greedy argmax of the LM head needs when it first screens every token with an int8
copy of the head and an error bound (a design for a later issue; nothing here is used by the engine).

    python -m experiments.bench.lm_screen [--prompts 12] [--max-tokens 64]

The idea: a greedy step needs only the argmax of each row's logits, and the LM head is 21% of the bytes a SmolLM2
forward reads (49152 x 576 bf16 = 56.6 MB). Screen with int8 weights (per-group scales, ~29 MB): a token's screened
logit is within ``bound_j = sum over groups of scale_jg / 2 x ||x_g||_1`` (+ a worst-case fp32 rounding slack for the
two dot products) of its exact one, so every token whose screened logit + bound reaches the largest screened logit -
bound is a candidate and no other can be the argmax; the exact logits of the candidates' 32-wide packed panels, through
the same kernel as the full product (batch invariance: an output's value does not depend on the rows beside it),
then give the argmax bit for bit, ties to the first index. This script measures the candidate counts on real hidden
states: the final-normed states of MT-bench and Spec-Bench answers (greedy, the default model and dtype), x rounded
to bf16 as the kernels round it.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6, help="MT-bench first turns (plus 2 each of rag, coding, math)")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    from specdec import LLM, SamplingParams
    from specdec.engine.interface import ForwardBatch
    from specdec.experiment.data import load_spec_bench

    llm = LLM("smollm2-135m-instruct", dtype="auto", max_num_seqs=1, max_model_len=2048)
    eng = llm.engine
    W = eng._stack.lm_head.w.float()  # [V, D] the packed head's values
    V, D = W.shape
    hs = []  # [n, D] per answer: the hidden states whose logits choose each answer token
    for q in list(load_spec_bench("mt_bench"))[: a.prompts] + list(load_spec_bench(["rag", "coding", "math"], 2)):
        ids = llm.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=a.max_tokens),
                           use_tqdm=False)[0]
        toks = ids + list(out.outputs[0].token_ids)
        slot = eng.allocate_slot()
        hs.append(eng.forward(ForwardBatch(torch.tensor(toks), [slot], [len(toks)])).hidden_states[len(ids) - 1:])
        eng.free_slot(slot)
    X = torch.cat(hs).to(torch.bfloat16).float()  # [N, D]
    am = (X @ W.T).argmax(1)  # [N]
    # worst-case rounding of two fp32 dot products of D terms (each pair step rounded twice): 4 D 2^-24 ||x||_1 max|w|
    slack = 4 * D * 2.0 ** -24 * X.abs().sum(1, keepdim=True) * W.abs().amax(1)[None, :]  # [N, V]
    print(f"{X.shape[0]} rows, LM head [{V}, {D}] = {V * D * 2 / 1e6:.1f} MB in bf16")
    # with x quantised too (int8 x int8 dot products, AVX512-VNNI's vpdpbusd): x / sx rounded, sx = max|x_g| / 127 per
    # row and group g (the same groups as the weights')
    # xq: 1 = x in one int8 digit per element; 2 = two (the rounding residual in a second digit at 1/254 the step)
    for bits, G, xq in ((8, D, 0), (8, 192, 0), (8, 64, 0), (8, 32, 0), (4, 32, 0), (8, 64, 1), (8, 32, 1), (8, 64, 2)):
        L = 2 ** (bits - 1) - 1
        Wg = W.view(V, D // G, G)
        s = Wg.abs().amax(-1, keepdim=True) / L  # [V, D/G, 1]
        Wq = (torch.round(Wg / s).clamp(-L, L) * s).view(V, D)
        Xg = X.view(-1, D // G, G)
        sx = Xg.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127  # [N, D/G, 1]
        x1 = torch.round(Xg / sx) * sx
        step = sx if xq == 1 else sx / 254  # the last digit's step
        xs = x1 if xq == 1 else x1 + torch.round((Xg - x1) / step) * step
        scr = (xs.view(-1, D) if xq else X) @ Wq.T  # [N, V]
        bound = Xg.abs().sum(-1) @ (s.squeeze(-1) / 2).T + slack  # [N, V]
        if xq:  # + the x quantisation's: sum over groups of step_g / 2 x ||w^_jg||_1
            bound = bound + (step.squeeze(-1) / 2) @ Wq.view(V, D // G, G).abs().sum(-1).T
        cand = scr + bound >= (scr - bound).max(1, keepdim=True).values
        n = cand.sum(1).float()
        panels = cand.view(cand.shape[0], -1, 32).any(2).sum(1).float()
        mb = V * D * bits / 8 / 1e6 + V * (D // G) * 2 / 1e6
        print(f"int{bits}{['', ' weights, int8 x,', ' weights, 2 x int8 x,'][xq]} group {G:3d} ({mb:.1f} MB with fp16 scales): candidates per row mean {n.mean():.1f} median "
              f"{n.median():.0f} p90 {n.quantile(.9):.0f} p99 {n.quantile(.99):.0f} max {n.max():.0f}; 32-wide panels "
              f"mean {panels.mean():.1f} max {panels.max():.0f}; the argmax always a candidate: "
              f"{bool(cand[torch.arange(len(am)), am].all())}; bound mean {bound.mean():.3f}")


if __name__ == "__main__":
    main()
