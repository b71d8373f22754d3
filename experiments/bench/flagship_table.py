"""One row per run of ``python -m specdec.run``: the figures issue #48 item 4 asks of every experiment, from its
summary.json (the theory's convention: specdec/experiment/theory.py).

    python -m experiments.bench.flagship_table outputs/2026-11-28/10-40-00 outputs/2026-11-28/10-45-00 ...
    python -m experiments.bench.flagship_table --markdown outputs/...       # a table to paste into experiments/LOG.md

Columns (k = the draft depth: the tree depth for scorer=tree, the chain's length otherwise; every time a mean per
decode step of the run):
- t(1) ms: the plain baseline's decode step in the same run (``baseline_step_time_s.step``);
- draft ms: the propose phase per step, and per depth (propose / k: theory's c x t(1));
- verify ms: the score phase (the target's forward over the scored tokens), and the verify phase beside it
  (rejection, KV rollback, threading: time the theory does not model);
- tau: tokens per step, bonus included (``mean_acceptance_length``);
- predicted speedup = tau / (v + k c) with v = score / t(1), c = propose / k / t(1), recomputed here from the
  phase times through ``specdec.experiment.theory.speedup`` (and checked against the summary's own
  ``predicted_speedup`` where it has one: a mismatch is printed, not hidden);
- measured speedup [95% CI]: tokens/s over the baseline's in the same run, bootstrap over questions;
- efficiency = measured / predicted.

Knows nothing about how the runs were made: a run without speculation or without a baseline gets '-' where a
figure needs either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec.experiment.theory import speedup

COLUMNS = ("experiment", "t1_ms", "draft_ms", "draft_ms_per_depth", "score_ms", "verify_ms", "tau", "predicted",
           "measured", "ci95", "efficiency")


def experiment_name(s: dict[str, Any], run_dir: str) -> str:
    """The run's experiment override (``+experiment=...``) where the config kept it, else its proposer and shape."""
    cfg = s.get("config") or {}
    if cfg.get("experiment"):
        return str(cfg["experiment"])
    prop, scorer = cfg.get("proposer") or {}, cfg.get("scorer") or {}
    name = str(prop.get("_target_", "none")).rsplit(".", 1)[-1]
    if scorer.get("tree_depth"):
        name += f" {scorer['tree_depth']}x{scorer.get('tree_topk')}x{scorer.get('tree_budget')}"
    m = (prop.get("options") or {}).get("ngram_branch")
    if m:
        name += f"+{(prop.get('options') or {}).get('branch', 'ngram')}{m}"
    return name or Path(run_dir).name


def row(s: dict[str, Any], run_dir: str = "") -> dict[str, Any]:
    """The table's figures of one summary.json (parsed); None where the run cannot give one."""
    phases, base = s.get("step_time_s") or {}, s.get("baseline_step_time_s") or {}
    k = len(s.get("acceptance_per_position") or [])  # the share of steps accepting depth 1..k (metrics.per_position)
    # the head's depths (a grafted n-gram branch may reach past them, so k can exceed them): the draft's forwards
    depths = min(k, (s.get("config") or {}).get("scorer", {}).get("tree_depth") or k)
    t1, propose, score = base.get("step"), phases.get("propose"), phases.get("score")
    tau = s.get("mean_acceptance_length")
    pred = None
    if k > 0 and t1 and propose is not None and score is not None and tau is not None:
        pred = speedup(tau, score / t1, propose / k / t1, k)
    measured = s.get("speedup")
    ms = (lambda x: None if x is None else 1e3 * x)
    return dict(experiment=experiment_name(s, run_dir), t1_ms=ms(t1), draft_ms=ms(propose),
                draft_ms_per_depth=ms(propose / depths) if (propose is not None and depths > 0) else None,
                score_ms=ms(score), verify_ms=ms(phases.get("verify")), tau=tau, predicted=pred, measured=measured,
                ci95=s.get("speedup_ci95"), efficiency=measured / pred if (pred and measured is not None) else None,
                summary_predicted=s.get("predicted_speedup"), k=k)


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def cells(r: dict[str, Any]) -> list[str]:
    ci = r["ci95"]
    meas = _f(r["measured"]) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    return [r["experiment"], _f(r["t1_ms"]), _f(r["draft_ms"]), _f(r["draft_ms_per_depth"]), _f(r["score_ms"]),
            _f(r["verify_ms"]), _f(r["tau"], 3), _f(r["predicted"]), meas, _f(r["efficiency"])]


HEAD = ["experiment", "t(1) ms", "draft ms/step", "draft ms/depth", "verify (score) ms", "verify phase ms", "tau",
        "predicted", "measured [95% CI]", "efficiency"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories (each holding summary.json) or summary.json paths")
    ap.add_argument("--markdown", action="store_true", help="a markdown table (experiments/LOG.md's form)")
    a = ap.parse_args(argv)
    rows = []
    for run in a.runs:
        p = Path(run)
        p = p / "summary.json" if p.is_dir() else p
        if not p.exists():
            raise SystemExit(f"flagship_table: {p} does not exist; give a run directory of python -m specdec.run")
        r = row(json.loads(p.read_text()), str(p.parent))
        if r["predicted"] is not None and r["summary_predicted"] is not None and \
                abs(r["predicted"] - r["summary_predicted"]) > 1e-6 * max(1.0, r["predicted"]):
            print(f"flagship_table: {p}: predicted speedup recomputed {r['predicted']:.4f} but the summary says "
                  f"{r['summary_predicted']:.4f} (tau from the counts' product form vs mean_acceptance_length?)",
                  file=sys.stderr)
        rows.append(r)
    table = [cells(r) for r in rows]
    if a.markdown:
        print("| " + " | ".join(HEAD) + " |")
        print("|" + "---|" * len(HEAD))
        for c in table:
            print("| " + " | ".join(c) + " |")
        return
    widths = [max(len(h), *(len(c[i]) for c in table)) for i, h in enumerate(HEAD)]
    print("  ".join(h.ljust(w) for h, w in zip(HEAD, widths)))
    for c in table:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)))


if __name__ == "__main__":
    main()
