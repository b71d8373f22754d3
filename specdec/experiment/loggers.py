"""Experiment loggers: ``logger=none`` (:class:`NullLogger`) and ``logger=wandb`` (:class:`WandbLogger`).

The run calls a logger four times a run and once per question, never inside the engine's step loop:
``start`` (config, run dir, sweep group), ``log_question`` (that question's τ, acceptance rate and
tokens/s, one W&B step per question), ``log_summary`` (the run's figures and the theory beside them:
predicted τ, v, c, predicted speedup, efficiency; per-position acceptance, conditional alpha_i and the
speculation policy's chosen k as bar charts, per-category table, summary.json as an artifact) and ``finish``.

A logging failure is a warning, never an error: :class:`WandbLogger` catches every exception from W&B,
warns once naming the call, and goes on without W&B. Knows nothing about how the figures are computed.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from specdec.experiment.summary import RequestRecord, RunSummary, mean_chosen_k

log = logging.getLogger("specdec.loggers")
# what the measured alpha, v and c predict (specdec/experiment/theory.py), logged beside the measured figures
THEORY_SCALARS = ("alpha_iid", "predicted_tau", "predicted_tau_iid", "verify_cost", "draft_cost",
                  "predicted_speedup", "efficiency")


class NullLogger:
    """Logs nothing (``logger=none``); the base of every logger."""

    def start(self, config: dict[str, Any], run_dir: Path, group: str | None = None,
              name: str | None = None) -> None:
        pass

    def log_question(self, index: int, record: RequestRecord) -> None:
        pass

    def log_summary(self, summary: RunSummary, summary_path: Path) -> None:
        pass

    def finish(self) -> None:
        pass


def question_figures(record: RequestRecord) -> dict[str, float]:
    """One question's τ, acceptance rate, tokens/s (and speedup when a baseline ran), under the run's names."""
    from specdec.datamodel.metrics import tau

    out: dict[str, float] = {"tokens_per_s": record.num_generated_tokens / record.seconds if record.seconds else 0.0}
    if record.acceptance_counts and record.acceptance_counts[0]:
        out["mean_acceptance_length"] = tau(record.acceptance_counts)
    if record.num_draft_tokens:
        out["acceptance_rate"] = sum(record.acceptance_counts[1:]) / record.num_draft_tokens
    if record.baseline_seconds and record.seconds and record.num_generated_tokens:
        # tokens/s over the baseline's tokens/s: sampled runs emit different counts (a ratio of times would not be)
        base_tokens = record.baseline_num_generated_tokens
        base_tokens = record.num_generated_tokens if base_tokens is None else base_tokens
        if base_tokens:
            out["speedup"] = (record.num_generated_tokens / record.seconds) / (base_tokens / record.baseline_seconds)
    for name in ("ttft", "tpot", "itl"):  # seconds, the mean over the question's turns (RequestRecord)
        xs = getattr(record, f"{name}_s")
        if xs:
            out[f"{name}_s"] = sum(xs) / len(xs)
    return out


class WandbLogger(NullLogger):
    """Weights & Biases, offline unless ``mode="online"``; files go under the run directory (WANDB_DIR)."""

    def __init__(self, project: str = "specdec", entity: str | None = None, mode: str = "offline",
                 group: str | None = None, name: str | None = None, tags: list[str] | str | None = None,
                 job_type: str = "eval") -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode={mode!r}; choose offline, online or disabled")
        self.project, self.entity, self.mode = project, entity, mode
        if isinstance(tags, str):  # logger.tags=fast: one tag (list() would split it into letters)
            tags = [tags]
        if tags is not None and not (isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags)):
            raise ValueError(f"logger.tags={tags!r} must be a string or a list of strings, e.g. logger.tags=[fast,k4]")
        self.group, self.name, self.tags, self.job_type = group, name, list(tags or []), job_type
        self.run = None
        self.failed = False

    def _guard(self, what: str, fn, *args) -> None:
        if self.failed or (self.run is None and what != "init"):
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - W&B must never stop an experiment
            self.failed = True
            warnings.warn(f"W&B {what} failed ({type(e).__name__}: {e}); the run goes on without W&B logging",
                          RuntimeWarning, stacklevel=3)

    def start(self, config: dict[str, Any], run_dir: Path, group: str | None = None,
              name: str | None = None) -> None:
        def init() -> None:
            import wandb

            run_dir.mkdir(parents=True, exist_ok=True)
            os.environ["WANDB_DIR"] = str(run_dir)  # wandb/ goes under the run dir, never into the repo
            self.run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(run_dir),
                                  group=self.group or group, name=self.name or name, tags=self.tags,
                                  job_type=self.job_type, config=config, reinit="finish_previous")
            log.info("W&B run %s (%s) in %s, group %s", self.run.name, self.mode, run_dir, self.group or group)

        self._guard("init", init)

    def log_question(self, index: int, record: RequestRecord) -> None:
        figures = {f"question/{k}": v for k, v in question_figures(record).items()}
        self._guard("log", lambda: self.run.log({**figures, "question/index": index}, step=index))

    def log_summary(self, summary: RunSummary, summary_path: Path) -> None:
        self._guard("summary", self._log_summary, summary, summary_path)

    def _log_summary(self, summary: RunSummary, summary_path: Path) -> None:
        import wandb

        scalars = ("num_prompts", "num_generated_tokens", "mean_acceptance_length", "acceptance_rate",
                   "tokens_per_s", "baseline_tokens_per_s", "speedup", "speedup_mean_of_ratios", "draft_coverage",
                   "greedy_mismatches", "wall_time_s", *THEORY_SCALARS)
        self.run.summary.update({k: getattr(summary, k) for k in scalars if getattr(summary, k) is not None})
        self.run.summary.update({f"read_rate_gbs_{k}": v for k, v in summary.read_rate_gbs.items()})
        if summary.speedup_ci95:  # the speedup's bootstrap 95% interval over prompts
            self.run.summary.update({"speedup_ci95_lo": summary.speedup_ci95[0],
                                     "speedup_ci95_hi": summary.speedup_ci95[1]})
        self.run.summary.update({f"engine/{k}": v for k, v in summary.engine.items()})  # dtype, kernels, CPU
        self.run.summary.update({f"latency/{k}": v for k, v in summary.latency.items()})  # ttft_p50, tpot_mean, ...
        charts: dict[str, Any] = {}
        if summary.chosen_k_histogram:  # the speculation policy's k (tree: budget) per request-step
            self.run.summary.update({"speculation_policy": summary.speculation_policy,
                                     "mean_chosen_k": mean_chosen_k(summary.chosen_k_histogram)})
            # a priced policy's table at the end of the run
            self.run.summary.update({f"cost_table_ms/{r}": v for r, v in summary.cost_table_ms.items()})
            charts["chosen_k"] = wandb.plot.bar(
                wandb.Table(columns=["k", "request_steps"],
                            data=[[int(k), n] for k, n in summary.chosen_k_histogram.items()]),
                "k", "request_steps", title=f"Draft length chosen by the {summary.speculation_policy} policy")
        if summary.acceptance_per_position:
            table = wandb.Table(columns=["position", "acceptance"],
                                data=[[i + 1, a] for i, a in enumerate(summary.acceptance_per_position)])
            charts["acceptance_per_position"] = wandb.plot.bar(
                table, "position", "acceptance", title="Acceptance per draft position")
        alphas = [[i + 1, a] for i, a in enumerate(summary.alpha_per_position) if a is not None]  # reached only
        if alphas:
            charts["alpha_per_position"] = wandb.plot.bar(
                wandb.Table(columns=["position", "alpha"], data=alphas), "position", "alpha",
                title="Conditional acceptance alpha_i (given positions < i accepted)")
        cols = ["category", "num_prompts", "mean_acceptance_length", "acceptance_rate", "tokens_per_s",
                "baseline_tokens_per_s", "speedup", "speedup_ci95_lo", "speedup_ci95_hi", "draft_coverage",
                *THEORY_SCALARS]

        def cell(c, k):
            if k.startswith("speedup_ci95_"):
                return c.speedup_ci95[0 if k.endswith("lo") else 1] if c.speedup_ci95 else None
            return getattr(c, k)

        rows = [[cat] + [cell(c, k) for k in cols[1:]] for cat, c in summary.per_category.items()]
        rows.append(["overall"] + [cell(summary, k) for k in cols[1:]])
        charts["per_category"] = wandb.Table(columns=cols, data=rows)
        self.run.log(charts)
        artifact = wandb.Artifact(f"summary-{self.run.id}", type="summary",
                                  description="specdec RunSummary (summary.json)")
        artifact.add_file(str(summary_path), name="summary.json")
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:  # even after a failed log call: close what was opened
            run.finish()
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"W&B finish failed ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
