"""What drafting an EAGLE tree costs per step, against the target's one-token forward and the head's weight reads,
the re-feeding python expansion and the one-call native draft (the catch-up and every depth of the tree in one
``sd_eagle_tree`` call) side by side in one process (#48 item 1).

    python -m experiments.bench.draft_cost                       # EAGLE-3, the flagship's 7-token tree and 6x4x20
    python -m experiments.bench.draft_cost --methods eagle3,eagle --head-dtypes bfloat16,float32 --threads 2
    python -m experiments.bench.draft_cost --threads 1 --clock thread   # a shared box: CPU time, 1 thread

Greedy, batch 1, the default model in ``--dtype`` (auto: the default's) after a random ``--context``-token prefix (features from the target's
own forward). A step's draft is ``propose_tree``: the catch-up of ``--rows`` threaded rows (the pending token and
the accepted drafts; ~2 at tau ~2.4) and every depth of the tree, plus the grafted n-gram branch where the config
has one (native: catch-up + tree in one call, then the graft in python); the same batch each call (the catch-up
re-feeds the same rows), so every call does a steady-state step's work. Printed per case: ms per step (min over ``--rounds`` rounds of ``--calls`` calls, cases interleaved round by
round), the fraction of t(1) (the one-token target forward, timed the same way), and draft / (depth x the time to
read the head's weights once: layer + draft LM head bytes / the measured W.sum() read rate); then the same three
"in-step": each draft timed right after an untimed target forward, as a real step drafts. Back to back, the head's
12.9 MB stay in the 32 MB L3 from call to call; after a forward they do not, and the 7-token tree cost 1.50 ms
instead of 0.73 (2026-12-05, Zen 4): the in-step figure is what a step pays. Targets: the 7-token tree <= 0.08 t(1)
and <= 2x its reads, the 21-token tree <= 0.15 t(1). Compare figures within one run only.
"""

from __future__ import annotations

import argparse
import time

import torch

TREES = {"7": dict(tree_depth=3, tree_topk=3, tree_budget=6, ngram_branch=3),  # conf/experiment/eagle.yaml
         "21": dict(tree_depth=6, tree_topk=4, tree_budget=20, ngram_branch=0)}


def best_ms(fn, calls: int, clock=time.perf_counter) -> float:
    t = clock()
    for _ in range(calls):
        fn()
    return (clock() - t) / calls * 1e3


def ms_after(fn, before, calls: int, clock=time.perf_counter) -> float:
    """Mean ms of ``fn`` over ``calls`` calls, each right after an untimed ``before()`` (the target's forward: a
    real step drafts with the caches the forward left, cold for the head's weights and the step's Python)."""
    total = 0.0
    for _ in range(calls):
        before()
        t = clock()
        fn()
        total += clock() - t
    return total / calls * 1e3


def make_case(eng, method: str, tree: str, native: bool, dtype: str, tokens: list[int], rows: int):
    """-> (a zero-argument step, the proposer) for one case, its head already holding the context."""
    from specdec.datamodel.hidden_states import HiddenStates
    from specdec.datamodel.sampling_params import SamplingParams
    from specdec.engine import ForwardBatch
    from specdec.spec_decode.config import SpeculativeConfig
    from specdec.spec_decode.proposer import ProposeBatch, TreeShape
    from specdec.spec_decode.registry import resolve

    t = TREES[tree]
    opts = {"tree_native": native, "head_dtype": dtype, **({"ngram_branch": t["ngram_branch"]} if t["ngram_branch"] else {})}
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=t["tree_depth"], scorer="tree",
                            tree_depth=t["tree_depth"], tree_topk=t["tree_topk"], tree_budget=t["tree_budget"],
                            prompt_lookup_min=1, prompt_lookup_max=4, options=opts)
    prop = resolve("proposer", method)(eng, cfg)
    if native and prop.tree_kernel != "native":
        raise SystemExit(f"draft_cost: the native tree does not run here: {prop.tree_kernel}")
    slot = eng.allocate_slot()
    out = eng.forward(ForwardBatch(torch.tensor(tokens), [slot], [len(tokens)], hidden_layers=prop.features.layers))
    feats = torch.cat(out.aux_hidden_states, -1) if prop.features.layers else out.hidden_states  # [L, F]
    eng.free_slot(slot)
    shape = TreeShape(t["tree_depth"], t["tree_topk"], t["tree_budget"])

    def batch(n: int) -> ProposeBatch:  # the last n rows threaded (feature of token i-1 for token i)
        return ProposeBatch([0], [tokens], t["tree_depth"], [SamplingParams(temperature=0.0)], [None],
                            HiddenStates(feats[len(tokens) - 1 - n: len(tokens) - 1], _seq_ids=[0] * n))

    prop.propose_tree(batch(len(tokens) - 1), shape)  # the prefix into the head's slot
    step = batch(rows)
    return (lambda: prop.propose_tree(step, shape)), prop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="eagle3", help="eagle3 and/or eagle (EAGLE-1: the full target vocabulary)")
    ap.add_argument("--trees", default="7,21", help=f"of {sorted(TREES)}")
    ap.add_argument("--head-dtypes", default="bfloat16", help="the packing of the head's weights (options.head_dtype): "
                    "bfloat16 (the default, auto on x86) and/or float32")
    ap.add_argument("--dtype", default="auto", help="the target's weights (auto: the default, bf16 where the CPU has it)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", type=int, default=2, help="threaded rows per step (pending token + accepted drafts)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of this thread (needs --threads 1): steadier on a shared box, blind to waits")
    a = ap.parse_args()
    if a.clock == "thread" and a.threads != 1:
        raise SystemExit("draft_cost: --clock thread counts only the calling thread's CPU time; use it with --threads 1")
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    torch.set_num_threads(a.threads)

    from specdec.engine import ForwardBatch
    from specdec.engine.bench import read_rate_gbs
    from specdec.engine.cpu.build import status
    from specdec.engine.loader import DEFAULT_MODEL, load_engine

    eng = load_engine(DEFAULT_MODEL, num_slots=4, max_model_len=a.context + 64, dtype=a.dtype)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, eng.vocab_size, (a.context,), generator=g).tolist()
    tslot = eng.allocate_slot()
    eng.forward(ForwardBatch(torch.tensor(tokens[:-1]), [tslot], [a.context - 1]))

    def one_token():
        eng.rollback(tslot, a.context - 1)
        eng.forward(ForwardBatch(torch.tensor(tokens[-1:]), [tslot], [1]))

    cases = {}
    for method in a.methods.split(","):
        for tree in a.trees.split(","):
            for dtype in a.head_dtypes.split(","):
                for native in (False, True):
                    cases[(method, tree, dtype, native)] = make_case(eng, method, tree, native, dtype, tokens, a.rows)
    rate = read_rate_gbs(512 * 2**20)
    times = {key: float("inf") for key in cases} | {"t1": float("inf")}
    in_step = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for fn in [one_token] + [c[0] for c in cases.values()]:
            fn()  # warm
        for _ in range(a.rounds):  # interleaved: noise hits every case alike
            times["t1"] = min(times["t1"], best_ms(one_token, a.calls, clock))
            for key, (fn, _) in cases.items():
                times[key] = min(times[key], best_ms(fn, a.calls, clock))
                in_step[key] = min(in_step[key], ms_after(fn, one_token, a.calls, clock))
    t1 = times["t1"]
    print(f"{DEFAULT_MODEL} {str(eng.dtype).removeprefix('torch.')}, {status()}, threads={a.threads}, context {a.context}, {a.rows} threaded rows; "
          f"{a.clock} clock; read rate (W.sum) {rate:.1f} GB/s; t(1) = {t1:.2f} ms")
    print(f"{'method':7} {'tree':>4} {'head':8} {'path':7} {'ms/step':>8} {'/ t(1)':>7} {'ms/depth':>8} "
          f"{'read ms':>8} {'/ reads':>8} | {'in-step':>8} {'/ t(1)':>7} {'/ reads':>8}")
    for (method, tree, dtype, native), (_, prop) in cases.items():
        ms, depth = times[(method, tree, dtype, native)], TREES[tree]["tree_depth"]
        nbytes = prop.tree_call.nbytes if prop.tree_call is not None else None
        if nbytes is None:  # the python path's proposer has no tree call: the same head's bytes, from its twin
            twin = cases.get((method, tree, dtype, True))
            nbytes = twin[1].tree_call.nbytes if twin else 0
        read = nbytes / rate / 1e6  # ms to read the head's weights once
        ratio = f"{ms / (depth * read):8.2f}" if read else f"{'-':>8}"
        ins = in_step[(method, tree, dtype, native)]
        ins_ratio = f"{ins / (depth * read):8.2f}" if read else f"{'-':>8}"
        print(f"{method:7} {tree:>4} {dtype:8} {'native' if native else 'python':7} {ms:8.2f} {ms / t1:7.3f} "
              f"{ms / depth:8.2f} {read:8.3f} {ratio} | {ins:8.2f} {ins / t1:7.3f} {ins_ratio}")
    print("targets (#48): 7-token tree <= 0.08 t(1) and <= 2x its reads ('/ reads' = ms / (depth x read ms)); "
          "21-token tree <= 0.15 t(1). 'in-step': each draft right after a target forward, as in a step (the head's "
          "weights and the step's Python then come from memory, not the caches): the figure a step pays")


if __name__ == "__main__":
    main()
