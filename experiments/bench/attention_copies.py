"""A bf16 model's attention over bf16 copies of K and V against fp32 ones, side by side in one process.

    python -m experiments.bench.attention_copies [--context 768] [--reps 9] [--prefill 768] [--threads 2] [--quality 2]

One bf16 engine (``specdec.engine.bench.setup``: 16 slots of ragged random prefixes around ``--context``), two
native stacks over the same packed weights and the same fp32 KV cache: its own (``ops.attention_copies``: keys in
bf16 pairs scored with vdpbf16ps against the query rounded to bf16, values read from a bf16 copy; where the build has
AVX512_BF16) and one built with ``attention_dtype=torch.float32`` (fp32 keys and values, the attention before
2026-11-29). Before each timed forward the engine is pointed at one stack or the other, alternating within each
repetition so the machine's drift hits both; each stack's copies follow every rollback. Per case (M new tokens after
the context at B = 1, one-token decode at batch B, a prompt of ``--prefill`` tokens into an empty slot): the min over
``--reps`` of each, their ratio, the largest logit difference between the two and whether their greedy tokens agree
on every row (random tokens: near-ties are common). ``--quality N``: both against the fp32 model on real text (top-1
agreement and KL, ``quality``). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.engine.bench import B_CASES, M_CASES, read_rate_gbs, setup, weight_bytes
from specdec.engine.cpu.stack import NativeStack
from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import DEFAULT_MODEL, load_engine


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="also a prompt of N <= context tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quality", type=int, default=0, metavar="N",
                    help="also teacher-force N Spec-Bench prompts per category against the fp32 model")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    eng, slots, lens, g = setup(a.model, a.context, "bfloat16")
    own = eng._stack
    if own is None or own.vh is None:
        raise SystemExit("this engine's attention keeps fp32 copies already (no native AVX512_BF16 build): "
                         "nothing to compare")
    fp32 = NativeStack(eng.model, eng.cache, share=own, attention_dtype=torch.float32)
    stacks = {"bf16 copies": own, "fp32 copies": fp32}

    def once(stack, batch_slots, ids, q, fresh):
        for s in batch_slots:  # both stacks' copies follow the cut (the engine only tells the one it holds)
            eng.rollback(s, 0 if fresh else lens[s])
            for st in stacks.values():
                st.truncate(s, 0 if fresh else lens[s])
        eng._stack = stack
        last = torch.arange(1, len(batch_slots) + 1) * q - 1 if fresh else None
        t = time.perf_counter()
        out = eng.forward(ForwardBatch(ids, batch_slots, [q] * len(batch_slots), logits_indices=last))
        return (time.perf_counter() - t) * 1e3, out.logits

    def case(batch_slots, q, fresh=False):
        best = dict.fromkeys(stacks, float("inf"))
        diff, agree = 0.0, True
        for r in range(a.reps + 1):  # the first repetition warms up
            ids = torch.randint(0, eng.vocab_size, (len(batch_slots) * q,), generator=g)  # [B * q]
            outs = {}
            for name, st in (stacks.items() if r % 2 else reversed(stacks.items())):
                t, outs[name] = once(st, batch_slots, ids, q, fresh)
                if r:
                    best[name] = min(best[name], t)
            x, y = outs["bf16 copies"], outs["fp32 copies"]  # [rows, V]
            diff = max(diff, float((x - y).abs().max()))
            agree = agree and torch.equal(x.argmax(-1), y.argmax(-1))
        eng._stack = own
        return best, diff, agree

    nbytes = weight_bytes(eng)
    rate = read_rate_gbs(2 * nbytes)
    print(f"model={a.model} bf16 threads={torch.get_num_threads()} context={a.context} reps={a.reps}; read rate "
          f"{rate:.1f} GB/s ({nbytes / 1e6:.0f} MB of weights = {nbytes / rate / 1e6:.2f} ms per forward)")
    print("| case | fp32 copies ms | bf16 copies ms | ratio | max logit diff | same greedy tokens |")
    print("|---|---|---|---|---|---|")
    rows = [("M", m, [slots[8]], m) for m in M_CASES] + [("B", b, slots[:b], 1) for b in B_CASES]
    if a.prefill:
        rows.append(("P", a.prefill, slots[9:10], a.prefill))  # last: it overwrites slot 9's prefix
    result = {"args": vars(a), "read_gb_s": rate, "cases": []}
    for key, c, bs, q in rows:
        best, diff, agree = case(bs, q, fresh=key == "P")
        ratio = best["bf16 copies"] / best["fp32 copies"]
        result["cases"].append({"case": f"{key}={c}", **best, "ratio": ratio, "max_diff": diff, "agree": agree})
        print(f"| {key}={c} | {best['fp32 copies']:.2f} | {best['bf16 copies']:.2f} | {ratio:.2f} | {diff:.3f} | "
              f"{'yes' if agree else 'no'} |", flush=True)
    print(f"read rate at the end {read_rate_gbs(2 * nbytes):.1f} GB/s")
    if a.quality:
        result["quality"] = quality(a.model, a.quality)
    return result


def quality(model: str, per_category: int) -> dict:
    """How far each bf16 attention moves the bf16 model from the fp32 one, teacher-forced on real text: Spec-Bench's
    first turns (``per_category`` per category, chat template) each followed by the fp32 model's greedy 128 tokens;
    over those 128 positions per prompt, the share where the greedy token equals the fp32 model's and the mean
    KL(fp32 || bf16) of the next-token distributions. -> {stack name: {"top1": share, "kl": mean}}."""
    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench

    ref = LLM(model, max_num_seqs=1, max_model_len=4096, dtype="float32")
    seqs = []
    for q in load_spec_bench(None, per_category):
        ids = ref.chat_prompt_ids([{"role": "user", "content": q.turns[0]}])
        out = ref.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=128), use_tqdm=False)
        seqs.append((ids, list(out[0].outputs[0].token_ids)))
    e32 = ref.engine
    eng = load_engine(model, num_slots=1, max_model_len=4096, dtype="bfloat16")
    stacks = {"bf16 copies": eng._stack,
              "fp32 copies": NativeStack(eng.model, eng.cache, share=eng._stack, attention_dtype=torch.float32)}
    slot, s32 = eng.allocate_slot(), e32.allocate_slot()

    def logits(engine, s, ids, n):  # [n, V] the next-token logits after each of the last n positions' prefixes
        engine.rollback(s, 0)
        rows = torch.arange(len(ids) - n - 1, len(ids) - 1)
        return engine.forward(ForwardBatch(torch.tensor(ids), [s], [len(ids)], logits_indices=rows)).logits.float()

    out = {name: {"top1": 0.0, "kl": 0.0} for name in stacks}
    total = 0
    for prompt, cont in seqs:
        ids, n = prompt + cont, len(cont)
        lp32 = torch.log_softmax(logits(e32, s32, ids, n), -1)  # [n, V]
        total += n
        for name, st in stacks.items():
            for other in stacks.values():
                other.truncate(slot, 0)
            eng._stack = st
            lp = torch.log_softmax(logits(eng, slot, ids, n), -1)
            out[name]["top1"] += float((lp.argmax(-1) == lp32.argmax(-1)).sum())
            out[name]["kl"] += float((lp32.exp() * (lp32 - lp)).sum())
    eng._stack = stacks["bf16 copies"]
    print(f"quality over {len(seqs)} prompts x their fp32 greedy continuation ({total} positions), against fp32 weights:")
    for name, r in out.items():
        r["top1"], r["kl"] = r["top1"] / total, r["kl"] / total
        print(f"  bf16 weights, {name}: greedy token = fp32's at {r['top1']:.4f} of positions, mean KL {r['kl']:.5f}")
    return out


if __name__ == "__main__":
    main()
