"""The flagship's tree shape by replay and measured costs: tau per shape, draft and verify cost, predicted speedup
(issue #48 item 3).

    python -m experiments.bench.tree_shapes --trace runs/trace-mt-e3                 # the quick grid (~6-9 min)
    python -m experiments.bench.tree_shapes --trace runs/trace-mt-e3 --reuse         # costs alone, tau from --out (~2.5 min)
    python -m experiments.bench.tree_shapes --trace runs/trace-mt-e3 --grid full     # depth 2-6 x topk 2-5 x ...
    python -m experiments.bench.tree_shapes                                          # + record the trace (~4 min)

In one process:
1. Trace (unless ``--trace``): a plain greedy run of MT-bench first turns (16 prompts, 128 tokens) with the
   target's features at the EAGLE-3 head's layers in float32, so the replay is bit-exact:
   ``python -m specdec.run proposer=none trace=true trace_features=true trace_features_dtype=float32
   'trace_layers=[1,14,26]' dataset=mt_bench turns=1 measure_baseline=false warmup=false``.
2. tau per shape: ``specdec.experiment.replay.replay`` of ``+experiment=eagle`` with the shape's overrides
   (scorer.tree_depth / tree_topk / tree_budget, proposer.options.ngram_branch = m, options.branch). Exact: the
   counts equal a live run's (tests/experiment/test_replay.py). No timing is taken from the replay.
3. Costs, timed side by side in one process after the replays, with the live run's 2 threads and the wall clock
   by default (``--threads 1 --clock thread``, CPU time, is steadier on a shared box but ranks differently: one
   thread makes each scored row dearer, see experiments/LOG.md 2026-11-28 10:30-): t(1) = the one-token target forward after ``--context``
   tokens; v(N + 1) = the forward over the N + 1 scored tokens / t(1) (a causal forward of that many rows, as
   specdec/spec_decode/cost_model.py's table; the tree mask changes no matmul); the draft = one step of
   ``propose_tree`` as experiments/bench/draft_cost.py times it (the same batch each call: a catch-up of
   ``--rows`` threaded rows and every depth, native tree, the branch grafted on). Every case is the min over
   ``--rounds`` rounds of ``--calls`` calls, the cases interleaved round by round; ``noise`` is the largest
   (median - min) / min over the rounds of any case, printed so a margin can be read against it.
4. Predicted speedup = specdec.experiment.theory.speedup(tau, v, c, depth) = tau / (v + depth c), c = draft ms /
   depth / t(1). Verification, bookkeeping and the step loop are not modelled (the live efficiency, measured
   speedup / predicted, was 0.92 for the flagship): the ranking is what this script is for.

Writes ``tree_shapes.csv`` to ``--out``; prints the table sorted by predicted speedup, the flagship's row marked.
Compare figures within one run only.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# (median - min) / min of a timed case above which a run is set aside: on 2026-11-28 every run at <= 0.07 put the
# 5-node tree +3.8-6.8% ahead of the 6-node one; runs at 0.14-13.6 scattered from -6% to +5% (experiments/LOG.md)
NOISY = 0.1
FLAGSHIP_LAYERS = "[1,14,26]"  # the EAGLE-3 head's target layers (SmolLM2-135M, 30 layers: 1, L//2-1, L-4)


@dataclass(frozen=True)
class Shape:
    depth: int
    topk: int
    budget: int  # draft nodes, the branch's included; the target scores budget + 1 tokens
    m: int  # options.ngram_branch: the grafted branch's length (0 = the head alone)
    branch: str = "ngram"  # options.branch: ngram (prompt lookup) | suffix (suffix decoding)

    @property
    def name(self) -> str:
        b = "head" if not self.m else f"{self.branch}{self.m}"
        return f"{self.depth}x{self.topk}x{self.budget}+{b}"

    def overrides(self) -> list[str]:
        return ["+experiment=eagle", f"proposer.num_speculative_tokens={self.depth}",
                f"scorer.tree_depth={self.depth}", f"scorer.tree_topk={self.topk}", f"scorer.tree_budget={self.budget}",
                f"proposer.options.ngram_branch={self.m}", f"++proposer.options.branch={self.branch}",
                "proposer.speculation_policy=static"]  # the shape's whole tree every step (the flagship's goodput policy
        # would need a cost table to replay, and would score fewer nodes than the shape names)

    def options(self) -> dict:
        return {"ngram_branch": self.m, "branch": self.branch} if self.m else {}


def valid(s: Shape) -> bool:
    """A budget the dynamic tree can fill (<= topk + (depth-1) topk^2 head candidates, plus the branch), a depth it
    can reach (depth <= budget), and a branch the proposer accepts (m < budget; it may reach past the depth)."""
    return s.depth <= s.budget <= s.topk + (s.depth - 1) * s.topk ** 2 + s.m and s.m < s.budget


def grid(name: str) -> list[Shape]:
    """``quick``: around the flagship and the cheaper-drafting candidates (46 replays); ``full``: depth 2-6 x topk
    2-5 x budget 4-24 x {head alone, n-gram m = min(depth, 3), and at depth 3-4 the suffix branch}."""
    if name == "smoke":  # the flagship and its head alone: a check of this script
        shapes = [Shape(3, 3, 6, 3), Shape(3, 3, 6, 0)]
    elif name == "quick":
        pts = [(d, k, b) for d, k, b in [(2, 2, 4), (2, 3, 4), (2, 3, 6), (3, 2, 4), (3, 2, 6), (3, 3, 6), (3, 3, 8),
                                         (3, 3, 10), (3, 4, 8), (3, 4, 10), (3, 4, 12), (4, 2, 6), (4, 3, 8),
                                         (4, 3, 10), (4, 3, 12), (4, 4, 12), (4, 4, 16), (5, 3, 10), (5, 3, 12),
                                         (5, 4, 16), (6, 4, 20), (6, 5, 24)]]
        shapes = [Shape(d, k, b, min(d, 3, b - 1)) for d, k, b in pts]
        shapes += [Shape(d, k, b, 0) for d, k, b in [(3, 3, 6), (3, 3, 10), (4, 3, 10), (6, 4, 20)]]
        shapes += [Shape(d, k, b, min(d, 3), "suffix") for d, k, b in [(3, 3, 6), (3, 3, 10), (4, 3, 10), (4, 4, 12)]]
        shapes += [Shape(4, 3, 10, 4), Shape(4, 3, 12, 4), Shape(5, 3, 12, 5), Shape(3, 3, 6, 2)]
        shapes += [Shape(3, 2, 5, 3), Shape(3, 3, 5, 3), Shape(3, 3, 7, 3), Shape(4, 3, 7, 3), Shape(3, 3, 7, 3, "suffix")]
        shapes += [Shape(3, 4, 10, 6), Shape(3, 4, 12, 6), Shape(3, 3, 8, 6), Shape(3, 4, 10, 8), Shape(3, 3, 10, 6),
                   Shape(4, 3, 10, 6), Shape(3, 4, 10, 6, "suffix")]  # branches past the depth (the flagship's)
    elif name == "full":
        shapes = [Shape(d, k, b, m, br) for d in range(2, 7) for k in range(2, 6) for b in (4, 6, 8, 10, 12, 16, 20, 24)
                  for m, br in [(0, "ngram"), (min(d, 3), "ngram")] + ([(3, "suffix")] if d in (3, 4) else [])]
    else:
        raise SystemExit(f"tree_shapes: --grid {name!r}: one of quick, full")
    return [s for s in dict.fromkeys(shapes) if valid(s)]


def conf_shape() -> Shape:
    """The shape conf/experiment/eagle.yaml holds now (always replayed and marked in the table)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = compose(config_name="config", overrides=["+experiment=eagle"])
    opts = c.proposer.get("options") or {}
    return Shape(c.scorer.tree_depth, c.scorer.tree_topk, c.scorer.tree_budget, int(opts.get("ngram_branch", 0)),
                 str(opts.get("branch", "ngram")))


def record_trace(out: Path) -> Path:
    import subprocess
    import sys

    trace = out / "trace"
    cmd = [sys.executable, "-m", "specdec.run", "proposer=none", "trace=true", "trace_features=true",
           "trace_features_dtype=float32", f"trace_layers={FLAGSHIP_LAYERS}", "dataset=mt_bench", "turns=1",
           "measure_baseline=false", "warmup=false", f"output_dir={trace}"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return trace


def replay_tau(trace: Path, s: Shape, out: Path, reuse: bool = False) -> dict:
    import json

    from hydra import compose, initialize_config_dir

    from specdec.experiment.replay import replay

    done = out / s.name / "summary.json"
    if reuse and done.exists():  # a replay of this shape already written under --out (of the same --trace)
        summ = json.loads(done.read_text())
        if Path(summ["replay"]["trace"]).resolve() == (trace / "trace").resolve():
            return dict(tau=summ["mean_acceptance_length"], acc=summ["acceptance_per_position"],
                        steps=summ["replay"]["steps"])

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="replay", overrides=s.overrides() + [f"run_dir={trace.resolve()}",
                                                                     f"output_dir={out / s.name}"])
    summ = replay(cfg)
    # acceptance_per_position: depths 1..k, the share of steps accepting at least that depth
    return dict(tau=summ.mean_acceptance_length, acc=list(summ.acceptance_per_position), steps=summ.replay["steps"])


# ---------------------------------------------------------------------------------------------- costs
def draft_step(eng, s: Shape, tokens: list[int], rows: int):
    """A zero-argument steady-state draft step of shape ``s`` (experiments/bench/draft_cost.py's make_case, with the
    branch drafter as an option): the head holds the context; each call re-feeds the same ``rows`` threaded rows."""
    from specdec.datamodel.hidden_states import HiddenStates
    from specdec.datamodel.sampling_params import SamplingParams
    from specdec.engine import ForwardBatch
    from specdec.spec_decode.config import SpeculativeConfig
    from specdec.spec_decode.proposer import ProposeBatch, TreeShape
    from specdec.spec_decode.registry import resolve

    cfg = SpeculativeConfig(method="eagle3", num_speculative_tokens=s.depth, scorer="tree", tree_depth=s.depth,
                            tree_topk=s.topk, tree_budget=s.budget, prompt_lookup_min=1, prompt_lookup_max=4,
                            options={"tree_native": True, **s.options()})
    prop = resolve("proposer", "eagle3")(eng, cfg)
    if prop.tree_kernel != "native":
        raise SystemExit(f"tree_shapes: the native tree does not run here ({prop.tree_kernel}); the flagship drafts "
                         "with it, so these costs would not be the flagship's")
    slot = eng.allocate_slot()
    out = eng.forward(ForwardBatch(torch.tensor(tokens), [slot], [len(tokens)], hidden_layers=prop.features.layers))
    feats = torch.cat(out.aux_hidden_states, -1)  # [L, 3 H]
    eng.free_slot(slot)
    shape = TreeShape(s.depth, s.topk, s.budget)

    def batch(n: int):  # the last n rows threaded (the feature of token i-1 for token i)
        return ProposeBatch([0], [tokens], s.depth, [SamplingParams(temperature=0.0)], [None],
                            HiddenStates(feats[len(tokens) - 1 - n: len(tokens) - 1], _seq_ids=[0] * n))

    prop.propose_tree(batch(len(tokens) - 1), shape)  # the prefix into the head's slot
    step = batch(rows)
    return lambda: prop.propose_tree(step, shape)


def costs(shapes: list[Shape], a) -> tuple[dict, dict, float, float, float, str]:
    """-> (draft ms per shape's cost key, forward ms per row count, t(1) ms, noise, W.sum read GB/s, the weights'
    dtype), timed in this process. A draft's cost key is (depth, topk, budget, m, branch) as the shape; a forward's
    the scored rows."""
    from specdec.engine import ForwardBatch
    from specdec.engine.bench import read_rate_gbs
    from specdec.engine.loader import DEFAULT_MODEL, load_engine

    from experiments.bench.draft_cost import best_ms

    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    max_rows = max(s.budget for s in shapes) + 1
    eng = load_engine(DEFAULT_MODEL, num_slots=len(shapes) + 2, max_model_len=a.context + max_rows + 64,
                      dtype=a.dtype)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, eng.vocab_size, (a.context,), generator=g).tolist()
    tslot = eng.allocate_slot()
    eng.forward(ForwardBatch(torch.tensor(tokens[:-1]), [tslot], [a.context - 1]))
    extra = torch.randint(0, eng.vocab_size, (max_rows,), generator=g)

    def forward(n: int):
        def run():
            eng.rollback(tslot, a.context - 1)
            eng.forward(ForwardBatch(extra[:n], [tslot], [n]))
        return run

    cases: dict = {("fwd", n): forward(n) for n in sorted({1} | {s.budget + 1 for s in shapes})}
    for s in shapes:
        cases[("draft", s)] = draft_step(eng, s, tokens, a.rows)
    rate = read_rate_gbs(512 * 2**20)
    runs: dict = {key: [] for key in cases}
    with torch.inference_mode():
        for fn in cases.values():
            fn()  # warm
        for _ in range(a.rounds):  # interleaved: load on the box hits every case alike
            for key, fn in cases.items():
                runs[key].append(best_ms(fn, a.calls, clock))
    best = {key: min(v) for key, v in runs.items()}
    noise = max((statistics.median(v) - min(v)) / min(v) for v in runs.values())
    drafts = {key[1]: ms for key, ms in best.items() if key[0] == "draft"}
    fwds = {key[1]: ms for key, ms in best.items() if key[0] == "fwd"}
    return drafts, fwds, fwds[1], noise, rate, str(eng.dtype).removeprefix("torch.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a run directory with a trace of the target's features at the head's layers "
                    "(step 1 of the docstring); omitted: recorded into --out")
    ap.add_argument("--dtype", default="auto", help="the target's weights for the costs: auto (the live run's, as the "
                    "flagship resolves it: bf16 where the CPU has bf16 arithmetic) | float32 | bfloat16")
    ap.add_argument("--grid", default="quick", help="quick (46 shapes) | full (every valid shape: "
                    "327, ~1.5 h) | smoke (2)")
    ap.add_argument("--out", default=str(ROOT / "outputs/tree_shapes"))
    ap.add_argument("--shapes", default="", help="comma-separated names of the grid's shapes to keep (3x3x6+ngram3,...)")
    ap.add_argument("--reuse", action="store_true", help="take tau from the replays already under --out (same trace): "
                    "re-time the costs alone")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", type=int, default=2, help="threaded rows per draft step (~2 at tau ~2.4)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="the live run's (torch's default on the 2-core box): v(M)'s "
                    "shape depends on it (LOG 2026-11-28 10:30-: at 1 thread v(7) - v(5) was 0.32, at 2 threads 0.04)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of this thread (needs --threads 1): steadier on a shared box, blind to waits")
    a = ap.parse_args()
    if a.clock == "thread" and a.threads != 1:
        raise SystemExit("tree_shapes: --clock thread counts only the calling thread's CPU time; use it with --threads 1")
    import logging
    import os

    from specdec.experiment.theory import speedup

    logging.getLogger("specdec").setLevel(logging.WARNING)
    out = Path(a.out)
    trace = Path(a.trace) if a.trace else record_trace(out)
    shapes = list(dict.fromkeys(grid(a.grid) + [conf_shape()]))
    if a.shapes:  # a few of the grid's shapes, by name
        names = a.shapes.split(",")
        unknown = set(names) - {s.name for s in shapes}
        if unknown:
            raise SystemExit(f"tree_shapes: --shapes {sorted(unknown)} not in --grid {a.grid}; names as the table "
                             "prints them, e.g. 3x3x6+ngram3")
        shapes = [s for s in shapes if s.name in names]
    torch.set_num_threads(1)  # the replays time nothing: one thread leaves the other core to the box (~10 s each here)
    t0, taus = time.perf_counter(), {}
    for i, s in enumerate(shapes):
        taus[s] = replay_tau(trace, s, out / "replay", a.reuse)
        print(f"[{i + 1}/{len(shapes)}] {s.name}: tau {taus[s]['tau']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    t_replay = time.perf_counter() - t0
    drafts, fwds, t1, noise, rate, eng_dtype = costs(shapes, a)
    rows = []
    for s in shapes:
        v, c = fwds[s.budget + 1] / t1, drafts[s] / s.depth / t1
        r = taus[s]
        rows.append(dict(shape=s.name, depth=s.depth, topk=s.topk, budget=s.budget, m=s.m, branch=s.branch if s.m else "",
                         tau=r["tau"], v=v, c_step=drafts[s] / t1, draft_ms=drafts[s], pred=speedup(r["tau"], v, c, s.depth),
                         acc="/".join(f"{x:.3f}" for x in r["acc"])))
    rows.sort(key=lambda r: -r["pred"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tree_shapes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    flagship = conf_shape().name
    print(f"trace {trace}; {len(shapes)} shapes replayed in {t_replay:.0f} s; costs: {eng_dtype}, threads={a.threads}, {a.clock} clock, "
          f"context {a.context}, {a.rows} threaded rows, min of {a.rounds} x {a.calls} calls; t(1) = {t1:.2f} ms; "
          f"W.sum {rate:.1f} GB/s; noise (median - min) / min <= {noise:.3f}; load average {os.getloadavg()}")
    print(f"{'shape':18} {'tau':>6} {'v(N+1)':>7} {'draft/t1':>8} {'v + c':>6} {'pred':>6}  acceptance per depth")
    for r in rows:
        mark = "  <- flagship" if r["shape"] == flagship else ""
        print(f"{r['shape']:18} {r['tau']:6.3f} {r['v']:7.3f} {r['c_step']:8.3f} {r['v'] + r['c_step']:6.3f} "
              f"{r['pred']:6.3f}  {r['acc']}{mark}")
    if noise > NOISY or any(ms < t1 for ms in fwds.values()):  # a forward over more rows faster than one: a stall
        print(f"WARNING: noise {noise:.2f} (> {NOISY}?) or some v(N+1) < 1: the box was busy while timing; the ranking "
              "of shapes within a few percent of each other is not to be trusted: rerun with --reuse")
    print(out / "tree_shapes.csv")


if __name__ == "__main__":
    main()
