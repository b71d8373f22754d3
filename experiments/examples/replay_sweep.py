"""Record a trace once, then replay a k x n-gram-setting sweep against it in seconds (specdec/replay.py).

    python experiments/examples/replay_sweep.py                       # SmolLM2, 8 MT-bench first turns, 128 tokens
    python experiments/examples/replay_sweep.py --trace <run dir>     # reuse a recorded trace
    python experiments/examples/replay_sweep.py --compare-live        # + the cost: the k-sweep live, timed
    python experiments/examples/replay_sweep.py --compare-live --threads 1 --max-tokens 64   # LOG 2026-11-23
    python experiments/examples/replay_sweep.py --model tiny --max-tokens 32   # a smoke test in seconds

Writes ``replay_sweep.csv`` and ``replay_sweep.png`` (tau against k, one line per prompt_lookup_max) to
``--out``. With ``--compare-live`` it also runs the n-gram k-sweep (k = 1, 2, 4, 8, prompt_lookup_max = 3)
live, one ``specdec.experiment.run`` per point as a sweep would (model load included, no plain baseline, no warmup),
times both in this one process, checks that each point's replayed acceptance counts equal the live ones,
and prints a line for experiments/LOG.md. The same sweep from the command line:

    python -m specdec.run proposer=none trace=true measure_baseline=false output_dir=runs/trace
    python -m specdec.replay runs/trace -m proposer=ngram proposer.num_speculative_tokens=1,2,4,8 \\
        proposer.prompt_lookup_max=1,2,3,4
    python -m specdec.report multirun/<date>/<time>
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
KS = (1, 2, 4, 8)
NGRAM_MAX = (1, 2, 3, 4)


def cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="a run dir with trace/ (default: record one into --out/trace)")
    ap.add_argument("--model", default="smollm2", help="conf/model option (smollm2 | tiny)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=1, help="MT-bench questions per category (8 categories)")
    ap.add_argument("--out", default=str(ROOT / "experiments/examples/results/replay_sweep"))
    ap.add_argument("--compare-live", action="store_true", help="also run the k-sweep live and time both")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the model runs (num_threads)")
    args = ap.parse_args()

    from specdec.experiment.replay import replay
    from specdec.experiment.run import run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [f"model={args.model}", "dataset=mt_bench", f"dataset.per_category={args.per_category}", "turns=1",
              f"sampling.max_tokens={args.max_tokens}", "measure_baseline=false", "warmup=false"]
    if args.threads:
        common.append(f"num_threads={args.threads}")
    trace, t_record = args.trace, None
    if trace is None:
        trace = out / "trace"
        t = time.perf_counter()
        run(cfg("config", common + ["trace=true", f"output_dir={trace}"]))  # plain greedy decoding, traced
        t_record = time.perf_counter() - t

    rows, t_rep = [], {}
    for n in NGRAM_MAX:
        for k in KS:
            t = time.perf_counter()
            s = replay(cfg("replay", ["proposer=ngram", f"proposer.num_speculative_tokens={k}",
                                      f"proposer.prompt_lookup_max={n}", f"run_dir={trace}",
                                      f"output_dir={out / f'replay_n{n}_k{k}'}"]))
            t_rep[(n, k)] = time.perf_counter() - t
            rows.append(dict(prompt_lookup_max=n, k=k, tau=s.mean_acceptance_length, acceptance_rate=s.acceptance_rate,
                             alpha_iid=s.alpha_iid, seconds=t_rep[(n, k)], counts=s.requests))
            print(f"replay n-gram max={n} k={k}: tau={s.mean_acceptance_length:.3f} ({t_rep[(n, k)]:.2f} s)")
    with open(out / "replay_sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt_lookup_max", "k", "tau", "acceptance_rate", "alpha_iid", "seconds"])
        w.writeheader()
        w.writerows({k: v for k, v in r.items() if k != "counts"} for r in rows)
    plot(rows, out / "replay_sweep.png")
    total = sum(t_rep.values())
    once = f" (trace recorded once in {t_record:.1f} s)" if t_record else ""
    print(f"{len(rows)} replayed points in {total:.1f} s{once}")
    if args.compare_live:
        compare_live(common, rows, t_rep, out, t_record)


def compare_live(common: list[str], rows, t_rep, out: Path, t_record) -> None:
    from specdec.experiment.run import run

    n = 3  # conf/proposer/ngram.yaml's prompt_lookup_max
    t_live, same = {}, []
    for k in KS:
        t = time.perf_counter()
        s = run(cfg("config", common + ["proposer=ngram", f"proposer.num_speculative_tokens={k}",
                                        f"proposer.prompt_lookup_max={n}", f"output_dir={out / f'live_k{k}'}"]))
        t_live[k] = time.perf_counter() - t
        rep = next(r for r in rows if r["k"] == k and r["prompt_lookup_max"] == n)
        same.append({q.question_id: q.acceptance_counts for q in s.requests}
                    == {q.question_id: q.acceptance_counts for q in rep["counts"]})
        print(f"live n-gram k={k}: tau={s.mean_acceptance_length:.3f} ({t_live[k]:.1f} s); replay "
              f"tau={rep['tau']:.3f} ({t_rep[(n, k)]:.2f} s); counts equal: {same[-1]}")
    live, rep = sum(t_live.values()), sum(t_rep[(n, k)] for k in KS)
    print(f"LOG: k-sweep {list(KS)} n-gram (max={n}): live {live:.1f} s, replay {rep:.2f} s -> {live / rep:.0f}x; "
          f"with the one-time trace recording ({t_record or 0:.1f} s): {live / (rep + (t_record or 0)):.1f}x; "
          f"replayed counts equal live at every point: {all(same)}")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for n in NGRAM_MAX:
        pts = [(r["k"], r["tau"]) for r in rows if r["prompt_lookup_max"] == n]
        ax.plot(*zip(*pts), marker="o", label=f"prompt_lookup_max={n}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(KS, [str(k) for k in KS])
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("n-gram drafts replayed against one trace")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
