"""`python -m specdec.report <sweep dir> [--x KEY] [--out DIR]`: a sweep's summary.json files -> CSV + plots.

Reads every ``summary.json`` under the directory (a Hydra multirun dir, or any folder of runs), finds the
config keys whose values differ between runs (the swept keys: ``proposer.num_speculative_tokens`` for
``-m proposer.num_speculative_tokens=1,2,4``), and writes to ``<dir>/report/`` (or ``--out``):

- ``report.csv``: one row per run and category (``overall`` first), with the swept keys as columns, the
  measured figures and the theory beside them (specdec/experiment/theory.py: ``predicted_tau``, ``verify_cost``,
  ``draft_cost``, ``predicted_speedup``, ``efficiency``, ..., and the conditional ``alpha_pos<i>``);
- ``tau.png``, ``speedup.png`` and ``draft_coverage.png``: against the swept value (``--x``, default: the swept
  key, a numeric one first), one line per Spec-Bench category plus the overall line (the speedup with its
  bootstrap 95% interval as error bars, and n prompts in the legend), and the overall theory dashed (τ of the
  fitted i.i.d. alpha; τ / (v + k c)); other swept keys (``+experiment=ngram,layer_skip``) make one panel
  each, on a shared y axis; a metric no run has (speedup without a baseline, a replay's) makes no file;
- ``alpha_per_position.png``: the conditional acceptance alpha_i (position i accepted given positions < i
  were), and ``acceptance_per_position.png`` the unconditional share, one line per run;
- ``results.md``: the runs as a markdown table, fastest first, with the speedup's interval, τ, alpha per
  position, draft coverage, predicted speedup and efficiency: which setting is fastest, and why.

Knows nothing about how runs are made: summary.json and its fields are the whole interface.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

from specdec.experiment.summary import RunSummary, read_summary

IGNORED_KEYS = ("output_dir", "logger.", "num_threads")  # differ between runs without being a sweep axis
FIGURES = ("num_prompts", "num_generated_tokens", "mean_acceptance_length", "acceptance_rate", "tokens_per_s",
           "baseline_tokens_per_s", "speedup", "speedup_ci95_lo", "speedup_ci95_hi", "speedup_mean_of_ratios",
           "draft_coverage", "alpha_iid", "predicted_tau", "predicted_tau_iid", "verify_cost", "draft_cost",
           "predicted_speedup", "efficiency")
# distinct styles beyond 10 lines: 20 colours, then the markers change too
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def style(i: int) -> dict[str, Any]:
    from matplotlib import colormaps

    return {"color": colormaps["tab20"](i % 20), "marker": MARKERS[(i // 20 + i) % len(MARKERS)]}


def figure(summary, name: str) -> Any:
    """A figure of a RunSummary / CategorySummary by CSV column name (the interval's ends included)."""
    if name.startswith("speedup_ci95_"):
        ci = summary.speedup_ci95
        return None if not ci else ci[0 if name.endswith("lo") else 1]
    return getattr(summary, name)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_runs(root: Path) -> list[tuple[Path, RunSummary]]:
    paths = sorted(p for p in Path(root).rglob("summary.json") if "report" not in p.relative_to(root).parts[:-1])
    if not paths:
        raise FileNotFoundError(f"no summary.json under {root}; give a multirun dir (multirun/<date>/<time>)")
    return [(p.parent, read_summary(p)) for p in paths]


def swept_keys(configs: list[dict[str, Any]]) -> list[str]:
    keys = sorted({k for c in configs for k in c})
    varying = [k for k in keys if not k.startswith(IGNORED_KEYS) and len({repr(c.get(k)) for c in configs}) > 1]
    numeric = [k for k in varying if all(isinstance(c.get(k), (int, float)) for c in configs)]
    return numeric + [k for k in varying if k not in numeric]


def series_keys(keys: list[str], configs: list[dict[str, Any]], x_key: str | None) -> list[str]:
    """The swept keys that split the runs beyond ``x_key``: a key whose value follows from x and the keys
    kept before it (``proposer.prompt_lookup_max`` when ``proposer._target_`` is swept) adds no panel."""
    kept: list[str] = []
    for k in sorted(keys, key=lambda k: not k.endswith(("_target_", "method", "name"))):  # what names a part first
        if k == x_key:
            continue
        seen: dict[tuple, str] = {}
        for c in configs:
            if seen.setdefault(tuple(repr(c.get(j)) for j in [x_key, *kept]), repr(c.get(k))) != repr(c.get(k)):
                kept.append(k)
                break
    return kept


def _label(key: str, value: Any) -> str:
    """'num_speculative_tokens=2', 'proposer=NGramProposer' (matplotlib hides labels starting with '_')."""
    parts = key.split(".")
    name = parts[-2] if parts[-1].startswith("_") and len(parts) > 1 else parts[-1].strip("_")
    return f"{name}={_short(value)}"


def _short(v: Any) -> str:
    s = str(v)
    return s.rsplit(".", 1)[-1] if isinstance(v, str) and "." in s and " " not in s else s


def _sort_key(v: Any) -> tuple:
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))


def write_csv(path: Path, rows: list[tuple[Path, dict[str, Any], RunSummary]], keys: list[str], root: Path) -> None:
    width = max((max(len(s.acceptance_per_position), len(s.alpha_per_position)) for _, _, s in rows), default=0)
    cols = ["run", *keys, "category", *FIGURES, "greedy_mismatches",
            *[f"acceptance_pos{i + 1}" for i in range(width)], *[f"alpha_pos{i + 1}" for i in range(width)]]

    def pad(xs: list) -> list:
        return list(xs) + [None] * (width - len(xs))

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for run_dir, cfg, s in rows:
            head = [str(run_dir.relative_to(root)) if run_dir != root else ".", *[cfg.get(k) for k in keys]]
            w.writerow([*head, "overall", *[figure(s, k) for k in FIGURES], s.greedy_mismatches,
                        *pad(s.acceptance_per_position), *pad(s.alpha_per_position)])
            for cat, c in s.per_category.items():
                w.writerow([*head, cat, *[figure(c, k) for k in FIGURES], None, *pad([]),
                            *pad(c.alpha_per_position)])


def _value(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def has_data(rows, metric: str) -> bool:
    return any(getattr(x, metric) is not None for _, _, s in rows for x in (s, *s.per_category.values()))


def plot_metric(path: Path, metric: str, label: str, rows, x_key: str | None, series_keys: list[str],
                theory: str | None = None) -> None:
    """One panel per series (shared y axis); ``theory`` names the field whose overall value is drawn dashed
    beside the metric; the speedup's interval is drawn as error bars on the overall line."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels: dict[str, list] = {}
    for i, (run_dir, cfg, s) in enumerate(rows):
        name = ", ".join(_label(k, cfg.get(k)) for k in series_keys) or "all runs"
        panels.setdefault(name, []).append((cfg.get(x_key) if x_key else i, s))
    fig = Figure(figsize=(6.5 * len(panels), 4.5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    cats_all = sorted({c for _, _, s in rows for c in s.per_category})
    for ax, (name, points) in zip(axes, panels.items()):
        points.sort(key=lambda p: _sort_key(p[0]))
        xs = [p[0] for p in points]
        xpos = xs if all(isinstance(x, (int, float)) for x in xs) else list(range(len(xs)))
        for ci, cat in enumerate(cats_all):
            ys = [_value(getattr(s.per_category[cat], metric)) if cat in s.per_category else math.nan
                  for _, s in points]
            if not all(math.isnan(y) for y in ys):
                ax.plot(xpos, ys, linewidth=1, alpha=0.7, label=cat, **style(ci))
        ys = [_value(getattr(s, metric)) for _, s in points]
        n = sorted({s.num_prompts for _, s in points})
        overall = f"overall (n={n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} prompts)"
        if metric == "speedup" and any(s.speedup_ci95 for _, s in points):
            lo = [y - s.speedup_ci95[0] if s.speedup_ci95 else 0.0 for y, (_, s) in zip(ys, points)]
            hi = [s.speedup_ci95[1] - y if s.speedup_ci95 else 0.0 for y, (_, s) in zip(ys, points)]
            ax.errorbar(xpos, ys, yerr=[lo, hi], marker="s", color="black", linewidth=2.5, capsize=4,
                        label=f"{overall}, 95% interval")
        elif not all(math.isnan(y) for y in ys):
            ax.plot(xpos, ys, marker="s", color="black", linewidth=2.5, label=overall)
        predicted = [_value(getattr(s, theory)) for _, s in points] if theory else []
        if not all(math.isnan(y) for y in predicted):
            ax.plot(xpos, predicted, marker="x", color="black", linestyle="--", linewidth=1.5,
                    label=f"overall, {theory}")
        if metric == "speedup":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        if xpos is not xs:
            ax.set_xticks(xpos, [_short(x) for x in xs], rotation=20)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=all(isinstance(x, int) for x in xs)))
        ax.set_xlabel(x_key or "run")
        ax.set_ylabel(label)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small", ncol=2)
    fig.savefig(path, dpi=110)


def plot_positions(path: Path, field: str, ylabel: str, rows, x_key: str | None, series_keys: list[str]) -> None:
    """One line per run over draft positions: ``field`` is alpha_per_position (conditional) or
    acceptance_per_position (unconditional)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    ordered = sorted(rows, key=lambda r: _sort_key(r[1].get(x_key)) if x_key else (0, 0, ""))
    for i, (run_dir, cfg, s) in enumerate(ordered):
        label = ", ".join(_label(k, cfg.get(k)) for k in ([x_key] if x_key else []) + series_keys)
        ys = [_value(a) for a in getattr(s, field)]
        if ys:
            ax.plot(range(1, len(ys) + 1), ys, label=label or run_dir.name, **style(i))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position i")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=1 + len(rows) // 12)
    fig.savefig(path, dpi=110)


def _fmt(x: Any, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def results_table(rows, keys: list[str], root: Path) -> str:
    """The runs as a markdown table, fastest first (by speedup, else by τ), and a line naming the best setting
    and the runs whose speedup interval overlaps it (not distinguishable from it on these prompts)."""
    def rank(r):
        s = r[2]
        return (s.speedup is None, -(s.speedup or 0.0), -(s.mean_acceptance_length or 0.0))

    ordered = sorted(rows, key=rank)
    width = max((len(s.alpha_per_position) for _, _, s in rows), default=0)
    head = ["run", *keys, "speedup", "95% interval", "n", "τ", *[f"α{i + 1}" for i in range(width)],
            "draft coverage", "predicted speedup", "efficiency", "tokens/s", "greedy mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run_dir, cfg, s in ordered:
        ci = f"[{s.speedup_ci95[0]:.2f}, {s.speedup_ci95[1]:.2f}]" if s.speedup_ci95 else "–"
        alphas = [_fmt(a) for a in s.alpha_per_position] + ["–"] * (width - len(s.alpha_per_position))
        cells = [str(run_dir.relative_to(root)) if run_dir != root else ".", *[_fmt(cfg.get(k)) for k in keys],
                 _fmt(s.speedup), ci, str(s.num_prompts), _fmt(s.mean_acceptance_length), *alphas,
                 _fmt(s.draft_coverage), _fmt(s.predicted_speedup), _fmt(s.efficiency), _fmt(s.tokens_per_s, 1),
                 _fmt(s.greedy_mismatches)]
        lines.append("| " + " | ".join(cells) + " |")
    best = ordered[0][2] if ordered else None
    text = "\n".join(lines) + "\n"
    if best is not None and best.speedup is not None:
        name = ", ".join(_label(k, ordered[0][1].get(k)) for k in keys) or str(ordered[0][0])
        tied = [", ".join(_label(k, c.get(k)) for k in keys) or str(d) for d, c, s in ordered[1:]
                if best.speedup_ci95 and s.speedup_ci95 and s.speedup_ci95[1] > best.speedup_ci95[0]]
        text += (f"\nFastest: {name} at {best.speedup:.2f}x"
                 + (f" (95% interval {best.speedup_ci95[0]:.2f}-{best.speedup_ci95[1]:.2f}x)" if best.speedup_ci95 else "")
                 + (f"; not distinguishable from it on these prompts: {'; '.join(tied)}" if tied else "") + ".\n")
    return text


def report(root: str | Path, out: str | Path | None = None, x: str | None = None) -> dict[str, Path]:
    """Write the CSV, results.md and the PNGs that have data; return their paths by name."""
    root = Path(root)
    runs = load_runs(root)
    configs = [flatten(s.config) for _, s in runs]
    keys = swept_keys(configs)
    if x is not None and x not in keys:
        raise ValueError(f"--x {x!r} is not a swept key of these runs; swept: {keys or 'none (one run)'}")
    preferred = "proposer.num_speculative_tokens"
    x_key = x or (preferred if preferred in keys else keys[0] if keys else None)
    series = series_keys(keys, configs, x_key)
    rows = [(d, c, s) for (d, s), c in zip(runs, configs)]
    out_dir = Path(out) if out else root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "report.csv", "results": out_dir / "results.md"}
    write_csv(paths["csv"], rows, keys, root)
    paths["results"].write_text(results_table(rows, keys, root))
    for name, metric, label, theory in (
            ("tau", "mean_acceptance_length", "τ (mean acceptance length)", "predicted_tau_iid"),
            ("speedup", "speedup", "speedup over plain decoding (ratio of means)", "predicted_speedup"),
            ("draft_coverage", "draft_coverage", "draft coverage (share of draft slots filled)", None)):
        if has_data(rows, metric):  # no panel without data
            paths[name] = out_dir / f"{name}.png"
            plot_metric(paths[name], metric, label, rows, x_key, series, theory=theory)
    for name, field, label in (("alpha", "alpha_per_position", "alpha_i: accepted given positions < i were"),
                               ("acceptance", "acceptance_per_position", "share of steps accepting position i")):
        if any(getattr(s, field) for _, _, s in rows):
            paths[name] = out_dir / f"{field}.png"
            plot_positions(paths[name], field, label, rows, x_key, series)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specdec.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", help="a Hydra multirun dir (multirun/<date>/<time>) or any folder of runs")
    ap.add_argument("--x", default=None, help="the swept config key on the x axis (default: the swept key)")
    ap.add_argument("--out", default=None, help="output folder (default: <sweep_dir>/report)")
    args = ap.parse_args(argv)
    paths = report(args.sweep_dir, args.out, args.x)
    for p in paths.values():
        print(p)


if __name__ == "__main__":
    main()
