"""RunSummary: what an experiment writes to summary.json (other tools read these fields by name).

Figures (specdec/experiment/speedup.py says why this definition):
- tokens/s = total generated tokens / total wall seconds over all questions (all turns);
- speedup = tokens/s / baseline tokens/s (a ratio of means), the baseline being the same questions decoded
  plainly in the same run, interleaved with the speculative decoding question by question (the order
  alternating); ``speedup_ci95`` its bootstrap 95% interval over questions; ``speedup_mean_of_ratios`` the mean
  of per-question ratios (Spec-Bench's tables) beside it;
- τ (mean acceptance length) = emitted tokens / decode steps pooled over all steps of all questions, bonus
  included (Spec-Bench's "#Mean accepted tokens", the mean of its per-step accept lengths).
Per Spec-Bench category, per Spec-Bench task (``mt_bench`` = its 8 categories pooled, translation,
summarization, qa, math_reasoning, rag) and overall.

Beside the measurement, the theory it implies (specdec/experiment/theory.py states the formulas and conventions):
``alpha_per_position`` (alpha_i, conditional on positions < i accepted; ``acceptance_per_position`` is
the unconditional share), ``alpha_iid``, ``predicted_tau`` (product form), ``predicted_tau_iid``,
``verify_cost`` (v), ``draft_cost`` (c), ``predicted_speedup`` = predicted_tau / (v + k c) and
``efficiency`` = speedup / predicted_speedup; None where the run has no speculation or no baseline.

Latencies (speculative run, seconds, specdec.datamodel.metrics.latency_stats): per request (one turn of a
question) TTFT = first token - arrival, TPOT = (finish - first token) / (tokens - 1), ITL = the gaps
between steps that emitted tokens (a speculative step emits several tokens at once: one gap). Each
question keeps its turns' values; ``RunSummary.latency`` pools them over all questions into
``{ttft,tpot,itl}_{mean,p50,p90,p99}`` (absent where no request had that figure).
"""

from __future__ import annotations

from typing import Any

import msgspec

from specdec.experiment.theory import Theory


class RequestRecord(msgspec.Struct, kw_only=True):
    question_id: str
    category: str
    num_prompt_tokens: int
    num_generated_tokens: int
    seconds: float  # wall time of this question (speculative run; batch > 1: its share of the steps)
    baseline_seconds: float | None  # the same prompt decoded plainly in the same run
    baseline_num_generated_tokens: int | None = None  # the baseline's own tokens (differ when sampling)
    finish_reason: str | None
    text: str
    greedy_match: bool | None  # speculative tokens == plain greedy tokens (greedy runs only)
    acceptance_counts: list[int] = msgspec.field(default_factory=list)  # summed over turns, positions 0..k
    num_draft_tokens: int = 0  # draft tokens proposed over this question's turns
    # this question's decode steps (speculative run): phase (propose/score/verify/step) -> summed seconds,
    # and -> number of steps that timed it; theory's v and c are pooled from these
    step_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    step_counts: dict[str, int] = msgspec.field(default_factory=dict)
    # the plain baseline's decode steps of the same question: summed seconds and count (t1 = their mean)
    baseline_step_seconds: float | None = None
    baseline_num_steps: int | None = None
    # per turn (request) of the speculative run: TTFT, and TPOT of the turns with >= 2 tokens; ITL pooled
    ttft_s: list[float] = msgspec.field(default_factory=list)
    tpot_s: list[float] = msgspec.field(default_factory=list)
    itl_s: list[float] = msgspec.field(default_factory=list)


class CategorySummary(Theory, kw_only=True):
    num_prompts: int
    num_generated_tokens: int
    mean_acceptance_length: float | None  # tau, bonus included (None: no decode step ran)
    acceptance_rate: float | None  # None without speculation
    tokens_per_s: float
    baseline_tokens_per_s: float | None
    speedup: float | None  # tokens/s / baseline tokens/s, each total tokens over total seconds
    speedup_ci95: list[float] | None = None  # [lo, hi]: bootstrap 95% interval over questions (None: < 2)
    speedup_mean_of_ratios: float | None = None  # mean over questions of tokens/s ratios (Spec-Bench's tables)
    draft_coverage: float | None = None  # drafted tokens / (k x decode steps): share of the draft slots filled


class RunSummary(Theory, kw_only=True):
    config: dict[str, Any]  # the resolved Hydra config
    num_prompts: int
    num_generated_tokens: int
    mean_acceptance_length: float | None  # tau over all decode steps, bonus included (1.0 = plain decoding)
    acceptance_rate: float | None  # accepted / proposed draft tokens (None without speculation)
    acceptance_per_position: list[float]
    tokens_per_s: float | None  # total tokens / total seconds; None: not measured (replay)
    baseline_tokens_per_s: float | None  # the same for the plain baseline; None when not measured
    speedup: float | None  # tokens_per_s / baseline_tokens_per_s (a ratio of means)
    per_category: dict[str, CategorySummary]
    greedy_mismatches: int | None  # None when not checked (sampling runs, or no baseline)
    wall_time_s: float
    step_time_s: dict[str, float] = msgspec.field(default_factory=dict)  # mean per phase
    # the plain baseline's mean decode step (phase "step"): the one-token forward t1 of the theory fields
    baseline_step_time_s: dict[str, float] = msgspec.field(default_factory=dict)
    per_task: dict[str, CategorySummary] = msgspec.field(default_factory=dict)  # Spec-Bench's report rows
    components: dict[str, str] = msgspec.field(default_factory=dict)  # group -> class the run built
    speedup_ci95: list[float] | None = None  # [lo, hi]: bootstrap 95% interval over questions
    speedup_mean_of_ratios: float | None = None  # mean over questions of tokens/s ratios (Spec-Bench's tables)
    draft_coverage: float | None = None  # drafted tokens / (k x decode steps): share of the draft slots filled
    # where the plain baseline came from: source (decoded | cache:<path> | <run dir>), key, remeasure_tokens
    baseline: dict[str, Any] = msgspec.field(default_factory=dict)
    requests: list[RequestRecord] = msgspec.field(default_factory=list)
    # the target engine: weight dtype, kernels (native ISA, or the torch reference and why), CPU capability
    engine: dict[str, str] = msgspec.field(default_factory=dict)
    # the CPU kernels' threads over the whole run (engine/cpu/threads.py): full, forwards, reduced_forwards (run
    # with fewer threads because another process took the cores: a busy machine; its figures are suspect)
    threads: dict[str, int] = msgspec.field(default_factory=dict)
    # the machine's memory read rate in GB/s (W.sum() over a buffer of the target's weight bytes, run.read_rate) before
    # the first question and after the last: "start", "end" (absent for models under 64 MB, whose weights fit in
    # caches). Absolute tokens/s follow it (a one-token forward streams the weights); compare only figures beside it
    read_rate_gbs: dict[str, float] = msgspec.field(default_factory=dict)
    # {ttft,tpot,itl}_{mean,p50,p90,p99} in seconds over every request (latency_summary)
    latency: dict[str, float] = msgspec.field(default_factory=dict)
    # the speculation policy (speculative_config speculation_policy) and its choices: k (a tree: node budget) ->
    # request-steps that got it, over the speculative run's decode steps (warm-up included); {} for plain runs
    speculation_policy: str | None = None
    chosen_k_histogram: dict[str, int] = msgspec.field(default_factory=dict)
    # a policy that prices steps (goodput): its cost table at the end of the run, one sequence's forward in ms per
    # scored rows (spec_decode/cost_model.py: the start-up shape, the level per batch size learnt live apart); {}
    # otherwise. The table is one draw of the host's memory phase: compare it with read_rate_gbs
    cost_table_ms: dict[str, float] = msgspec.field(default_factory=dict)


def policy_figures(llm) -> dict[str, Any]:
    """``speculation_policy``, ``chosen_k_histogram`` (and, for a policy with a cost table, ``cost_table_ms``) of an
    LLM's speculative worker ({} for a plain one)."""
    worker = getattr(llm, "worker", None)
    counts = getattr(worker, "chosen_counts", None)
    if counts is None:
        return {}
    out = {"speculation_policy": (llm.speculative_config or {}).get("speculation_policy", "static"),
           "chosen_k_histogram": {str(k): n for k, n in sorted(counts.items())}}
    if getattr(worker.policy, "needs_cost", False) and worker.cost.calibrated:
        out["cost_table_ms"] = {str(r): round(s * 1e3, 3) for r, s in zip(worker.cost.rows, worker.cost.secs)}
    return out


def mean_chosen_k(hist: dict[str, int]) -> float | None:
    n = sum(hist.values())
    return sum(int(k) * c for k, c in hist.items()) / n if n else None


def latency_summary(records: list[RequestRecord]) -> dict[str, float]:
    """Mean and p50/p90/p99 of TTFT, TPOT and ITL pooled over the records' requests (pure)."""
    from specdec.datamodel.metrics import percentiles

    out: dict[str, float] = {}
    for name in ("ttft", "tpot", "itl"):
        xs = [x for r in records for x in getattr(r, f"{name}_s")]
        if xs:
            out[f"{name}_mean"] = sum(xs) / len(xs)
            out.update({f"{name}_{q}": v for q, v in percentiles(xs, (50, 90, 99)).items()})
    return out


def write_summary(summary: RunSummary, path) -> None:
    from pathlib import Path

    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2))


def read_summary(path) -> RunSummary:
    from pathlib import Path

    return msgspec.json.decode(Path(path).read_bytes(), type=RunSummary)
