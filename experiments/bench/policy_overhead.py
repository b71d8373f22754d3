"""The speculation policy's own cost per step, live, and what it does to a saturated batch (#44).

    python -m experiments.bench.policy_overhead                     # SmolLM2, n-gram, batch 1 and 16, 2 threads
    python -m experiments.bench.policy_overhead --saturate 64 --reps 3 --threads 1   # + the saturated comparison

Part 1, the overhead: the goodput policy's per-step work (``GoodputPolicy.reuses_zeros`` and the worker's
``_choose``, ``_start_shadows`` and ``_resolve_shadows``, timed with the wall clock around each call) per decode
step, against the plain-path step (``_plain_decode``: one forward and sample of the whole batch) of an engine
whose policy does the same work and then drafts nothing (``Never``), on the same prompts, ``--tokens`` each, EOS
ignored. Batch 1: the first Spec-Bench prompt of every category, one at a time (the policy's work depends on
what it chooses: rows at 0 get shadow drafts), a row each and the worst; a larger ``--batches`` size: that many
prompts at once. #44's line is 2% of a one-token forward: the batch-1 plain step.

Part 2 (``--saturate N``): N prompts, ``max_num_seqs`` = the largest batch, EOS on, three configs rotated over
``--reps``: ``plain``; ``never``, the goodput policy doing all of its per-step work and then drafting nothing (its
cost alone); ``goodput``. Per config: tokens/s, TTFT p50 and TPOT p50 / mean from each request's metrics (TPOT as the
serving benchmark computes it). Plain's step sequence depends on the tokens only, so its figures repeat; goodput's
depends on measured times.

The read rate (``W.sum()``) is printed at the start and the end. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PHASES = ("reuses_zeros", "_choose", "_start_shadows", "_resolve_shadows", "_plain_decode")


class PhaseTimer:
    """Wall-clock seconds and calls of SpecDecodeWorker's PHASES, wrapped on the class while active."""

    def __init__(self) -> None:
        self.secs: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._orig: dict[str, object] = {}

    def __enter__(self) -> "PhaseTimer":
        from specdec.spec_decode.policy import GoodputPolicy
        from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker

        for name in PHASES:
            cls = GoodputPolicy if name == "reuses_zeros" else SpecDecodeWorker
            f = self._orig[name] = getattr(cls, name)

            def timed(*a, _f=f, _n=name, **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.secs[_n] = self.secs.get(_n, 0.0) + time.perf_counter() - t0
                    self.calls[_n] = self.calls.get(_n, 0) + 1

            setattr(cls, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        from specdec.spec_decode.policy import GoodputPolicy
        from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker

        for name, f in self._orig.items():
            setattr(GoodputPolicy if name == "reuses_zeros" else SpecDecodeWorker, name, f)


class PolicyWorkOnly:
    """Mixed into a policy class: all of its per-step work, then nothing drafted (every step takes the plain path)."""

    def choose(self, batch, cost):
        super().choose(batch, cost)
        return [0] * len(batch.limits)


def never_drafting(llm) -> None:
    """Replace ``llm``'s speculation policy with the same policy class under :class:`PolicyWorkOnly`."""
    cls = type(llm.worker.policy)
    llm.worker.policy = type(f"Never{cls.__name__}", (PolicyWorkOnly, cls), {})()


def overhead(llm, prompts: list[list[int]], tokens: int) -> dict:
    """One generate of ``prompts`` at once under ``llm`` (a goodput engine): the policy's ms per decode step and the
    plain-path step's ms."""
    from specdec import SamplingParams

    w = llm.worker
    s0 = w.plain_steps + w.spec_steps
    with PhaseTimer() as pt:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    steps = w.plain_steps + w.spec_steps - s0
    policy = sum(pt.secs.get(n, 0.0) for n in PHASES[:4])
    plain_n = pt.calls.get("_plain_decode", 0)
    return {"decode_steps": steps, "plain_steps": plain_n,
            "policy_ms_per_step": policy / steps * 1e3 if steps else None,
            "plain_step_ms": pt.secs["_plain_decode"] / plain_n * 1e3 if plain_n else None}


def share_row(goodput, never, prompts: list[list[int]], tokens: int) -> dict:
    """The goodput engine's policy ms per step on ``prompts`` against the never-drafting engine's plain step there."""
    r = overhead(goodput, prompts, tokens)
    r["forward_ms"] = overhead(never, prompts, tokens)["plain_step_ms"]
    r["share_pct"] = r["policy_ms_per_step"] / r["forward_ms"] * 100
    return r


def latencies(llm, prompts: list[list[int]], tokens: int) -> dict:
    from specdec import SamplingParams

    w = llm.worker
    k0, s0 = dict(getattr(w, "chosen_counts", {})), (getattr(w, "plain_steps", 0), getattr(w, "spec_steps", 0))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=tokens),
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    ks = {k: n - k0.get(k, 0) for k, n in getattr(w, "chosen_counts", {}).items() if n - k0.get(k, 0)}
    steps = (getattr(w, "plain_steps", 0) - s0[0], getattr(w, "spec_steps", 0) - s0[1])
    ttft, tpot = [], []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    return {"tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "ttft_p50_s": statistics.median(ttft), "tpot_p50_ms": statistics.median(tpot) * 1e3 if tpot else None,
            "tpot_mean_ms": statistics.mean(tpot) * 1e3 if tpot else None,
            "drafting_row_steps": sum(n for k, n in ks.items() if k), "row_steps": sum(ks.values()),
            "plain_path_steps": steps[0], "speculative_steps": steps[1],
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> dict:
    from experiments.bench.policy import configs, prompt_ids, read_rate
    from specdec import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--experiment", default="ngram")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--saturate", type=int, default=0, help="prompts for part 2 (0: skip it)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    base = LLM(args.model, max_num_seqs=max(batches), max_model_len=4096)
    pool = [ids for _, ids in prompt_ids(base, "all", 5)]
    warm = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]
    result: dict = {"args": vars(args), "read_gb_s_start": read_rate(), "overhead": {}, "saturated": {}}
    print(f"read rate {result['read_gb_s_start']:.1f} GB/s")
    goodput = base.with_speculation(configs(args.experiment)["goodput"])
    never = base.with_speculation(configs(args.experiment)["goodput"])
    never_drafting(never)
    for llm in (goodput, never):
        overhead(llm, warm, 16)  # the cost table, allocations
    cats = prompt_ids(base, "all", 1)
    for B in batches:
        sets = [(c, [ids]) for c, ids in cats] if B == 1 else [(f"{B} prompts", pool[:B])]
        rows = result["overhead"][B] = {name: share_row(goodput, never, ps, args.tokens) for name, ps in sets}
        print(f"\nbatch {B}: | prompts | policy ms per decode step | plain steps | forward ms | share |\n|---|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['policy_ms_per_step']:.3f} | {r['plain_steps']} of {r['decode_steps']} | "
                  f"{r['forward_ms']:.2f} | {r['share_pct']:.2f}% |")
        worst = max(rows, key=lambda n: rows[n]["share_pct"])
        mean = statistics.mean(r["share_pct"] for r in rows.values())
        print(f"batch {B}: worst {rows[worst]['share_pct']:.2f}% ({worst}), mean {mean:.2f}%")
    if args.saturate:
        llms = {"plain": base, "never": never, "goodput": goodput}
        for llm in llms.values():
            latencies(llm, warm, 16)
        prompts = pool[: args.saturate]
        order = list(llms)
        print(f"\nsaturated: {len(prompts)} prompts, {max(batches)} at a time, {args.tokens} tokens")
        print("| rep | config | tok/s | TTFT p50 s | TPOT p50 ms | TPOT mean ms | drafting row-steps | speculative steps "
              "| same tokens as plain |\n|---|---|---|---|---|---|---|---|---|")
        ref = None
        for rep in range(args.reps):
            for name in order[rep % 3:] + order[: rep % 3]:
                r = latencies(llms[name], prompts, args.tokens)
                toks = r.pop("tokens")
                ref = toks if ref is None and name == "plain" else ref
                r["same_tokens"] = None if ref is None else toks == ref
                result["saturated"].setdefault(name, []).append(r)
                print(f"| {rep + 1} | {name} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                      f"{r['tpot_p50_ms']:.1f} | {r['tpot_mean_ms']:.1f} | {r['drafting_row_steps']} of {r['row_steps']} | "
                      f"{r['speculative_steps']} of {r['speculative_steps'] + r['plain_path_steps']} | "
                      f"{r['same_tokens']} |", flush=True)
    result["read_gb_s_end"] = read_rate()
    print(f"read rate {result['read_gb_s_end']:.1f} GB/s")
    return result


if __name__ == "__main__":
    main()
