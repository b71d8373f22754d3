"""Pick EAGLE-2's dynamic-tree shape (scorer.tree_depth / tree_topk / tree_budget, proposer.options.draft_vocab_size)
for ``+experiment=eagle1`` / ``eagle3`` (the tree shape ``+experiment=eagle`` shares) from measured figures: acceptance by offline replay (specdec/replay.py, seconds per
point), costs timed in this same process.

    python -m experiments.train.tune_eagle_tree               # SmolLM2, the shipped EAGLE-1 head, full grid
    python -m experiments.train.tune_eagle_tree head=checkpoints/<new head> confirm=3
    python -m experiments.train.tune_eagle_tree trace=runs/tune_eagle_tree/trace    # reuse a recorded trace
    python -m experiments.train.tune_eagle_tree method=eagle3 head=checkpoints/smollm2-135m-instruct-eagle3
    python -m experiments.train.tune_eagle_tree depths=[3] topks=[3] budgets=[6] vocabs=[2048] max_tokens=32 \\
        categories=[writing,roleplay,math,coding] per_category=1 out=/tmp/tune     # a quick check

A Hydra app (conf/tune_eagle_tree.yaml): ``main`` is a thin wrapper around ``run(cfg)``.

In one process:
1. Trace (unless ``trace=DIR``): one plain greedy run with the target's features in float32 (the replay is
   then bit-exact), i.e. ``python -m specdec.run proposer=none trace=true trace_features=true
   trace_features_dtype=float32 dataset=mt_bench turns=1 measure_baseline=false`` (16 MT-bench first turns,
   128 tokens); ``method=eagle3`` records the head's three layers (``trace_layers``).
2. Acceptance: every grid point replayed (``proposer=<method> proposer.model=<head> scorer=tree``): tau and
   the share of steps accepting depth d. Skipped: budget > topk + (depth-1) topk^2 (EAGLE-2 expands topk
   nodes per depth, so no more candidates exist; tighter than sum_d topk^d) and depth > budget (the same tree
   as depth = budget, drafted at more cost). The current default (conf/experiment/eagle.yaml) is always
   replayed and checked (tau in [1, depth+1], acceptance falling with depth, and, with the live run of step
   4, its acceptance counts equal to the live ones question by question).
3. Costs: t_ms(n) = the target engine scoring n new tokens after ``context`` cached ones (default: the
   trace's mean prompt + half its output), median of ``reps`` calls: n = budget + 1 as scorers/tree.py scores
   a tree (tree_batch, then the forward with depth positions, the tree mask and the head's feature layers),
   n = 1 as a plain decode step's forward; v(n) = t(n) / t(1). draft_ms = mean wall time per replayed step of
   ``Top1Proposer.get_spec_proposals`` (the worker's propose phase; each point's first call left out as
   warm-up); c = draft_ms / t(1).
4. Predicted speedup = tau / (v(budget+1) + c + overhead). overhead = (step - propose - score) / t(1) from one
   live run of the default shape on ``overhead_prompts`` questions (a subset of the trace's, so its acceptance
   counts check the replay): verification and bookkeeping per step, taken as the same for every shape;
   ``overhead_prompts=0`` sets it to 0. The plain step's own sampling and loop time is not credited to the
   baseline (the run prints plain step = (1 + p) t(1)): predictions are low by that factor, the ranking is not
   affected. Writes ``tune_eagle_tree.csv`` (every point) and ``costs.json`` to ``out``; prints the top 10.
5. ``confirm=N``: the N best points live (specdec.experiment.run, measure_baseline=true: plain decoding of the same
   prompts in the same run): measured tau, tok/s and speedup beside the prediction (``confirm.csv``).

Timings from a shared machine are only comparable within one run of this script.
"""

from __future__ import annotations

import csv
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from experiments.train.common import comma_list, ints, options

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")  # specdec's own configs, which every point composes


def cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _h(v) -> str:
    """A value as a Hydra override writes it."""
    if v is None:
        return "null"
    return "[" + ",".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)


@dataclass(frozen=True)
class Shape:
    depth: int
    topk: int
    budget: int  # draft nodes; the target scores budget + 1 tokens
    vocab: int | None  # EAGLE-1 draft_vocab_size (0 = the full LM head); None = the head's own (EAGLE-3)

    @property
    def name(self) -> str:
        return f"d{self.depth}_k{self.topk}_b{self.budget}" + ("" if self.vocab is None else f"_v{self.vocab}")

    def overrides(self, method: str, head: str) -> list[str]:
        o = [f"proposer={method}", f"proposer.model={head}", f"proposer.num_speculative_tokens={self.depth}",
             "scorer=tree", f"scorer.tree_depth={self.depth}", f"scorer.tree_topk={self.topk}",
             f"scorer.tree_budget={self.budget}"]
        return o if self.vocab is None else o + [f"proposer.options.draft_vocab_size={self.vocab or 'null'}"]


def grid(depths, topks, budgets, vocabs) -> list[Shape]:
    """Every shape whose budget a dynamic tree can fill (<= its topk + (depth-1) topk^2 candidates) and
    whose depth it can reach (depth <= budget)."""
    return [Shape(d, k, b, v) for d in depths for k in topks for b in budgets for v in vocabs
            if d <= b <= k + (d - 1) * k * k]


def default_shape(method: str) -> Shape:
    c = cfg("config", ["+experiment=eagle1" if method == "eagle" else "+experiment=eagle3"])
    vocab = c.proposer.options.draft_vocab_size if method == "eagle" else None
    return Shape(c.scorer.tree_depth, c.scorer.tree_topk, c.scorer.tree_budget, vocab)


# ---------------------------------------------------------------------------------------------- trace
def trace_layers(method: str, head: str, model: str) -> list[int] | None:
    """The target layers the head reads: None = the last layer after the norm (EAGLE-1)."""
    if method == "eagle":
        return None
    from specdec.engine.loader import model_info
    from specdec.heads import eagle3_layers, read_head
    from specdec.heads.common import RANDOM_HEAD, resolve_head_path

    hc = None if head == RANDOM_HEAD else read_head(resolve_head_path(head, "tune_eagle_tree", "give head=<dir>"),
                                                    "eagle3")[0]
    return list((hc and hc.hidden_layers) or eagle3_layers(model_info(model).num_hidden_layers))


def record_trace(a, out: Path, threads: list[str]) -> Path:
    from specdec.experiment.run import run

    model = cfg("config", [f"model={a.model}"]).model.name
    layers = trace_layers(a.method, a.head, model)
    cats = a.categories if a.categories == "mt_bench" else _h(a.categories.split(","))
    run(cfg("config", [f"model={a.model}", "proposer=none", "dataset=mt_bench", f"dataset.categories={cats}",
                       f"dataset.per_category={a.per_category}", "turns=1", f"sampling.max_tokens={a.max_tokens}",
                       "measure_baseline=false", "warmup=false", "trace=true", "trace_features=true",
                       "trace_features_dtype=float32", f"trace_layers={_h(layers)}", f"output_dir={out}"] + threads))
    return out


def live_base(meta: dict) -> dict[str, str]:
    """Overrides that make specdec.experiment.run decode the trace's prompts as the trace did."""
    c, ds = meta["config"], meta["config"]["dataset"]
    if not str(ds.get("_target_", "")).endswith("load_spec_bench"):
        raise ValueError(f"tune_eagle_tree: live runs need a Spec-Bench/MT-bench trace; this one's dataset is {ds}")
    return {"model.name": meta["model"], "model.dtype": meta["dtype"], "dataset": "mt_bench",
            "dataset.categories": _h(ds.get("categories")), "dataset.per_category": _h(ds.get("per_category")),
            "dataset.path": _h(ds.get("path")), "turns": str(c["turns"]),
            "sampling.max_tokens": str(c["sampling"]["max_tokens"]), "max_model_len": str(meta["max_model_len"]),
            "seed": str(meta.get("seed", 0))}


def first_questions(meta: dict, n: int) -> dict[str, str]:
    """The first question of each of the trace's first n categories (a subset of its prompts)."""
    from specdec.experiment.data import MT_BENCH_CATEGORIES, SPEC_BENCH_CATEGORIES

    cats = meta["config"]["dataset"].get("categories")
    if cats in (None, "all"):
        cats = SPEC_BENCH_CATEGORIES
    elif cats == "mt_bench":
        cats = MT_BENCH_CATEGORIES
    names = [cats] if isinstance(cats, str) else list(cats)
    return {"dataset.categories": _h(names[:n]), "dataset.per_category": "1"}


# ---------------------------------------------------------------------------------------------- costs
def forward_ms(model: str, dtype: str, ns: list[int], context: int, reps: int,
               layers: tuple[int, ...]) -> dict[int, float]:
    """n -> median ms of the target's forward of n new tokens after ``context`` cached ones: n = 1 as a plain
    decode step, n > 1 as scorers/tree.py scores a tree (a binary tree of n-1 drafts under the pending token:
    its tree_batch, then the forward with positions by depth, the tree mask and the feature layers)."""
    from scorers.tree import tree_batch
    from specdec.engine import ForwardBatch
    from specdec.engine.bench import _time_ms
    from specdec.engine.loader import load_engine

    eng = load_engine(model, num_slots=1, max_model_len=context + max(ns) + 1, dtype=dtype)
    slot, g = eng.allocate_slot(), torch.Generator().manual_seed(0)
    eng.forward(ForwardBatch(torch.randint(0, eng.vocab_size, (context,), generator=g), [slot], [context],
                             logits_indices=torch.tensor([context - 1])))

    def step(n: int):
        ids = torch.randint(0, eng.vocab_size, (1, n), generator=g)  # [1, n] pending token + drafts
        parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, n)]])  # [1, n] root-inclusive

        def call():
            eng.rollback(slot, context)
            if n == 1:
                return eng.forward(ForwardBatch(ids[0], [slot], [1]))
            tb = tree_batch(parents, ids, torch.tensor([n - 1]), torch.tensor([context + 1]))  # as the scorer does
            eng.forward(ForwardBatch(tb.token_ids, [slot], tb.query_lens, positions=tb.positions,
                                     tree_mask=tb.tree_mask, hidden_layers=layers))

        return call

    return {n: _time_ms(step(n), reps)[1] for n in sorted(set(ns))}


@contextmanager
def timed_proposals():
    """Seconds of every ``Top1Proposer.get_spec_proposals`` call inside the block (the worker's propose phase)."""
    from specdec.spec_decode.top1_proposer import Top1Proposer

    orig, secs = Top1Proposer.get_spec_proposals, []

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig(self, *args, **kwargs)
        finally:
            secs.append(time.perf_counter() - t)

    Top1Proposer.get_spec_proposals = timed
    try:
        yield secs
    finally:
        Top1Proposer.get_spec_proposals = orig


def replay_point(trace: Path, method: str, head: str, s: Shape, out: Path) -> dict:
    from specdec.experiment.replay import replay

    t = time.perf_counter()
    with timed_proposals() as secs:
        summ = replay(cfg("replay", s.overrides(method, head) + [f"run_dir={trace}", f"output_dir={out / s.name}"]))
    warm = secs[1:] or secs
    return dict(depth=s.depth, topk=s.topk, budget=s.budget, vocab=s.vocab, tau=summ.mean_acceptance_length,
                acc=list(summ.acceptance_per_position), steps=summ.replay["steps"],
                steps_past=summ.replay["steps_past_recording"], draft_ms=1e3 * sum(warm) / max(len(warm), 1),
                replay_s=time.perf_counter() - t, counts={r.question_id: r.acceptance_counts for r in summ.requests})


def live(base: dict[str, str], s: Shape, method: str, head: str, out: Path, threads: list[str]):
    from specdec.experiment.run import run

    over = [f"{k}={v}" for k, v in base.items()] + s.overrides(method, head) + threads
    return run(cfg("config", over + ["measure_baseline=true", "warmup=true", f"output_dir={out}"]))


def check_default(row: dict, live_counts: dict | None) -> list[str]:
    """What looks wrong in the default shape's replay (empty: plausible)."""
    bad, acc = [], row["acc"]
    if not (row["tau"] and 1.0 <= row["tau"] <= row["depth"] + 1):
        bad.append(f"tau={row['tau']} outside [1, depth+1]")
    if any(b > a for a, b in zip(acc, acc[1:])):
        bad.append(f"acceptance per depth {acc} rises with depth")
    if acc and acc[0] == 0:
        bad.append("no depth-1 draft accepted: does the head fit this target and trace?")
    if live_counts is not None:
        shared = [q for q in live_counts if q in row["counts"]]
        diff = [q for q in shared if live_counts[q] != row["counts"][q]]
        if not shared or diff:
            bad.append(f"live and replayed acceptance counts differ on {len(diff)}/{len(shared)} shared questions")
    return bad


# ---------------------------------------------------------------------------------------------- main
def settings(cfg):
    """conf/tune_eagle_tree.yaml's keys as ``a.<key>``, checked; lists as lists, categories as "a,b"."""
    a = options(cfg, "tune_eagle_tree", {"method": ("eagle", "eagle3")})
    a.depths, a.topks, a.budgets, a.vocabs = (ints(v) for v in (a.depths, a.topks, a.budgets, a.vocabs))
    a.categories = comma_list(a.categories)
    a.out = a.out or str(ROOT / "runs/tune_eagle_tree")
    return a


def run(cfg) -> dict:
    """Trace, replay, time and predict (and confirm) as conf/tune_eagle_tree.yaml's keys say; ``cfg`` is a
    DictConfig (``common.compose("tune_eagle_tree", [...])``) or a plain mapping of every key."""
    from specdec.experiment.trace import load_trace

    a = settings(cfg)
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = [f"num_threads={a.threads}"] if a.threads else []
    a.head = a.head or cfg("config", [f"proposer={a.method}"]).proposer.model
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    default = default_shape(a.method)
    shapes = grid(a.depths, a.topks, a.budgets, a.vocabs if a.method == "eagle" else [None])
    shapes = [default] + [s for s in shapes if s != default]  # the default first: the reference

    # 1. trace
    trace = Path(a.trace) if a.trace else record_trace(a, out / "trace", threads)
    tr = load_trace(trace)
    meta, reqs = tr.meta, tr.request_rows()
    if any(r["temperature"] > 0 for r in reqs):
        raise ValueError(f"tune_eagle_tree: {trace} was sampled; tree acceptance is replayed from greedy traces only")
    context = a.context or round(sum(len(r["prompt_ids"]) + len(r["output_ids"]) / 2 for r in reqs) / len(reqs))

    # 3a. the target's forward
    ns = sorted({1} | {s.budget + 1 for s in shapes})
    t_ms = forward_ms(meta["model"], meta["dtype"], ns, context, a.reps, tuple(meta.get("feature_layers") or ()))
    v = {n: t / t_ms[1] for n, t in t_ms.items()}
    print(f"target forward at context {context}: t(1) = {t_ms[1]:.2f} ms; "
          + ", ".join(f"v({n})={v[n]:.2f}" for n in ns if n > 1))

    # 2 + 3b. acceptance and drafting time, replayed
    rows = []
    for i, s in enumerate(shapes):
        rows.append(replay_point(trace, a.method, a.head, s, out / "replay"))
        r = rows[-1]
        print(f"[{i + 1}/{len(shapes)}] {s.name}: tau={r['tau']:.3f} draft {r['draft_ms']:.2f} ms/step "
              f"({r['steps']} steps, {r['replay_s']:.1f} s)")

    d_row = rows[0]

    # 4. overhead from one live run of the default shape, then the prediction
    overhead, live_counts, live_info = 0.0, None, {}
    if a.overhead_prompts > 0:
        base = {**live_base(meta), **first_questions(meta, a.overhead_prompts)}
        live_info, live_counts = overhead_run(live(base, default, a.method, a.head, out / "live_default", threads),
                                              t_ms, default, d_row)
        overhead = live_info["overhead"]
    else:
        print("overhead = 0 (overhead_prompts=0): verification and bookkeeping are not modelled")
    for r in rows:
        r.update(v=v[r["budget"] + 1], c=r["draft_ms"] / t_ms[1], overhead=overhead)
        r["predicted_speedup"] = r["tau"] / (r["v"] + r["c"] + overhead)
    problems = check_default(d_row, live_counts)
    for p in problems:
        print(f"WARNING: the default {default.name}'s replay looks wrong: {p}")
    if not problems:
        same = "" if live_counts is None else ", acceptance counts equal to the live run's on every shared question"
        print(f"check: the default {default.name} replays at tau {d_row['tau']:.3f}, acceptance per depth "
              f"{[round(x, 3) for x in d_row['acc']]}{same}")
    rows.sort(key=lambda r: -r["predicted_speedup"])
    write_csv(out / "tune_eagle_tree.csv", rows, max(s.depth for s in shapes))
    (out / "costs.json").write_text(json.dumps(dict(
        context=context, reps=a.reps, t_ms=t_ms, v=v, live_default=live_info, trace=str(trace), head=a.head,
        method=a.method), indent=2))
    print_top(rows, out / "tune_eagle_tree.csv")

    # 5. the best points live
    confirmed = confirm(rows[: a.confirm], live_base(meta), a, t_ms, out, threads) if a.confirm else []
    return dict(rows=rows, t_ms=t_ms, overhead=overhead, live_default=live_info, problems=problems,
                confirmed=confirmed, default=default, trace=trace)


def overhead_run(sm, t_ms: dict[int, float], default: Shape, d_row: dict) -> tuple[dict, dict]:
    """(figures, acceptance counts per question) of the live default run; overhead in units of t(1)."""
    ms = {k: 1e3 * x for k, x in sm.step_time_s.items()}  # propose, score, verify, step: mean ms per step
    plain_ms = 1e3 * sm.baseline_step_time_s["step"]
    rest_ms = ms["step"] - ms["propose"] - ms["score"]
    info = dict(step_ms=ms, plain_step_ms=plain_ms, tau=sm.mean_acceptance_length, speedup=sm.speedup,
                overhead=rest_ms / t_ms[1], plain_extra=plain_ms / t_ms[1] - 1)
    n = default.budget + 1
    print(f"live default {default.name} ({sm.num_prompts} questions, speedup {sm.speedup:.3f}): propose "
          f"{ms['propose']:.2f} ms (replayed {d_row['draft_ms']:.2f}), score {ms['score']:.2f} ms (t({n}) "
          f"{t_ms[n]:.2f}), verify + rest {rest_ms:.2f} ms -> overhead {info['overhead']:.3f} t(1)")
    print(f"plain step {plain_ms:.2f} ms = (1 + {info['plain_extra']:.3f}) t(1): its sampling and loop time is not "
          "credited to the baseline, so predictions are low by that factor (the ranking is not affected)")
    return info, {r.question_id: r.acceptance_counts for r in sm.requests}


def write_csv(path: Path, rows: list[dict], depth_max: int) -> None:
    cols = ["depth", "topk", "budget", "vocab", "tau", *[f"acc_d{d}" for d in range(1, depth_max + 1)], "steps",
            "steps_past", "draft_ms", "v", "c", "overhead", "predicted_speedup", "replay_s"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, **{f"acc_d{d + 1}": x for d, x in enumerate(r["acc"])}} for r in rows)


def print_top(rows: list[dict], path: Path) -> None:
    print(f"\ntop 10 of {len(rows)} by predicted speedup ({path}):")
    print(" depth topk budget  vocab   tau  acc/depth                      v      c   pred")
    for r in rows[:10]:
        acc, vocab = " ".join(f"{x:.2f}" for x in r["acc"]), "-" if r["vocab"] is None else r["vocab"]
        print(f"{r['depth']:6d} {r['topk']:4d} {r['budget']:6d} {vocab:>6} {r['tau']:5.3f}  {acc:<29} "
              f"{r['v']:5.2f} {r['c']:6.3f} {r['predicted_speedup']:6.3f}")


def confirm(rows: list[dict], base: dict[str, str], a, t_ms: dict[int, float], out: Path,
            threads: list[str]) -> list[dict]:
    """Each row's shape live over the trace's prompts, with its plain baseline: measured beside predicted."""
    done = []
    for r in rows:
        s = Shape(r["depth"], r["topk"], r["budget"], r["vocab"])
        sm = live(base, s, a.method, a.head, out / f"confirm_{s.name}", threads)
        ms = {k: 1e3 * x for k, x in sm.step_time_s.items()}
        same = {q.question_id: q.acceptance_counts for q in sm.requests} == r["counts"]
        done.append(dict(shape=s.name, predicted_speedup=r["predicted_speedup"], speedup=sm.speedup,
                         replay_tau=r["tau"], live_tau=sm.mean_acceptance_length, counts_equal=same,
                         tokens_per_s=sm.tokens_per_s, baseline_tokens_per_s=sm.baseline_tokens_per_s,
                         draft_ms=r["draft_ms"], live_propose_ms=ms["propose"], score_ms=t_ms[s.budget + 1],
                         live_score_ms=ms["score"], live_step_ms=ms["step"]))
        print(f"confirm {s.name}: predicted {r['predicted_speedup']:.3f}x, measured {sm.speedup:.3f}x "
              f"({sm.tokens_per_s:.1f} vs {sm.baseline_tokens_per_s:.1f} tok/s plain); tau live "
              f"{sm.mean_acceptance_length:.3f}, replayed {r['tau']:.3f} (counts equal: {same})")
    with open(out / "confirm.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(done[0]))
        w.writeheader()
        w.writerows(done)
    return done


@hydra.main(version_base="1.3", config_path="conf", config_name="tune_eagle_tree")
def main(cfg: DictConfig) -> None:
    GlobalHydra.instance().clear()  # run() composes specdec's own conf/ with initialize_config_dir
    run(cfg)


if __name__ == "__main__":
    main()
