"""`python -m specdec.report <sweep dir> [--x KEY] [--out DIR]`: a sweep's summary.json files -> CSV + plots.

Reads every ``summary.json`` under the directory (a Hydra multirun dir, or any folder of runs), finds the
config keys whose values differ between runs (the swept keys: ``proposer.num_speculative_tokens`` for
``-m proposer.num_speculative_tokens=1,2,4``), and writes to ``<dir>/report/`` (or ``--out``):

- ``report.csv``: one row per run and category (``overall`` first), with the swept keys as columns, the
  measured figures and the theory beside them (specdec/experiment/theory.py: ``predicted_tau``, ``verify_cost``,
  ``draft_cost``, ``predicted_speedup``, ``efficiency``, ..., and the conditional ``alpha_pos<i>``);
- ``tau.png`` and ``speedup.png``: τ / speedup against the swept value (``--x``, default: the swept key,
  a numeric one first), one line per Spec-Bench category plus the overall line, and the overall theory
  dashed (τ of the fitted i.i.d. alpha; τ / (v + k c)); other swept keys
  (``+experiment=ngram,layer_skip``) make one panel each;
- ``acceptance_per_position.png``: the share of steps accepting draft position i, one line per run.

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
           "baseline_tokens_per_s", "speedup", "alpha_iid", "predicted_tau", "predicted_tau_iid", "verify_cost",
           "draft_cost", "predicted_speedup", "efficiency")


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
            w.writerow([*head, "overall", *[getattr(s, k) for k in FIGURES], s.greedy_mismatches,
                        *pad(s.acceptance_per_position), *pad(s.alpha_per_position)])
            for cat, c in s.per_category.items():
                w.writerow([*head, cat, *[getattr(c, k) for k in FIGURES], None, *pad([]),
                            *pad(c.alpha_per_position)])


def _value(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def plot_metric(path: Path, metric: str, label: str, rows, x_key: str | None, series_keys: list[str],
                theory: str | None = None) -> None:
    """One panel per series; ``theory`` names the field whose overall value is drawn dashed beside the metric."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels: dict[str, list] = {}
    for i, (run_dir, cfg, s) in enumerate(rows):
        name = ", ".join(_label(k, cfg.get(k)) for k in series_keys) or "all runs"
        panels.setdefault(name, []).append((cfg.get(x_key) if x_key else i, s))
    fig = Figure(figsize=(6.5 * len(panels), 4.5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, points) in zip(axes, panels.items()):
        points.sort(key=lambda p: _sort_key(p[0]))
        xs = [p[0] for p in points]
        xpos = xs if all(isinstance(x, (int, float)) for x in xs) else list(range(len(xs)))
        cats = sorted({c for _, s in points for c in s.per_category})
        for cat in cats:
            ys = [_value(getattr(s.per_category[cat], metric)) if cat in s.per_category else math.nan
                  for _, s in points]
            ax.plot(xpos, ys, marker="o", linewidth=1, alpha=0.7, label=cat)
        ax.plot(xpos, [_value(getattr(s, metric)) for _, s in points], marker="s", color="black", linewidth=2.5,
                label="overall")
        predicted = [_value(getattr(s, theory)) for _, s in points] if theory else []
        if not all(math.isnan(y) for y in predicted):
            ax.plot(xpos, predicted, marker="x", color="black", linestyle="--", linewidth=1.5,
                    label=f"overall, {theory}")
        if xpos is not xs:
            ax.set_xticks(xpos, [_short(x) for x in xs], rotation=20)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=all(isinstance(x, int) for x in xs)))
        if all(math.isnan(_value(getattr(s, metric))) for _, s in points):
            ax.text(0.5, 0.5, f"no {label} in these runs" + (" (no baseline measured)" if metric == "speedup" else ""),
                    transform=ax.transAxes, ha="center")
        ax.set_xlabel(x_key or "run")
        ax.set_ylabel(label)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
    fig.savefig(path, dpi=110)


def plot_acceptance(path: Path, rows, x_key: str | None, series_keys: list[str]) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    ordered = sorted(rows, key=lambda r: _sort_key(r[1].get(x_key)) if x_key else (0, 0, ""))
    for run_dir, cfg, s in ordered:
        label = ", ".join(_label(k, cfg.get(k)) for k in ([x_key] if x_key else []) + series_keys)
        ax.plot(range(1, len(s.acceptance_per_position) + 1), s.acceptance_per_position, marker="o",
                label=label or run_dir.name)
    if not any(s.acceptance_per_position for _, _, s in rows):
        ax.text(0.5, 0.5, "no speculative steps in these runs", transform=ax.transAxes, ha="center")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of steps accepting position i")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.savefig(path, dpi=110)


def report(root: str | Path, out: str | Path | None = None, x: str | None = None) -> dict[str, Path]:
    """Write the CSV and the three PNGs; return their paths by name."""
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
    paths = {"csv": out_dir / "report.csv", "tau": out_dir / "tau.png", "speedup": out_dir / "speedup.png",
             "acceptance": out_dir / "acceptance_per_position.png"}
    write_csv(paths["csv"], rows, keys, root)
    plot_metric(paths["tau"], "mean_acceptance_length", "τ (mean acceptance length)", rows, x_key, series,
                theory="predicted_tau_iid")  # the product form equals the measured τ: the i.i.d. form says more
    plot_metric(paths["speedup"], "speedup", "speedup over plain decoding", rows, x_key, series,
                theory="predicted_speedup")
    plot_acceptance(paths["acceptance"], rows, x_key, series)
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
