"""Speculative-decoding metrics: one counter struct plus pure functions that derive the rest.

Conventions (stated once, logged under exactly these names):
- ``spec_token_acceptance_counts[0]`` counts every decode step of a request (the target's own token);
  ``counts[i]`` (i >= 1) counts the steps whose i-th draft token was accepted. Prefill steps are not
  counted.
- ``mean_acceptance_length`` (tau) = emitted tokens / decode steps = sum(counts) / counts[0], **bonus
  token included** (1.0 = plain decoding).
- ``acceptance_rate`` = accepted / proposed draft tokens.
- ``acceptance_per_position[i]`` = counts[i+1] / counts[0]: share of steps accepting draft position i.
- ``system_efficiency`` = emitted / (steps * (k + 1)): 1.0 when every step emits its maximum.

Latency (from ``RequestMetrics``, seconds): TTFT = first_token_time - arrival_time; TPOT = (finished_time -
first_token_time) / (output tokens - 1), the mean time per output token after the first; ITL = the gaps
between successive emissions (a step that emits 3 tokens is one gap, as vLLM counts it).
"""

from __future__ import annotations

import msgspec

from collections.abc import Sequence

from specdec.datamodel.sequence import RequestMetrics


class SpecDecodeMetrics(msgspec.Struct, kw_only=True):
    num_steps: int  # decode steps summed over requests
    num_draft_tokens: int  # draft tokens proposed
    num_accepted_tokens: int  # draft tokens accepted
    num_emitted_tokens: int  # accepted + one target token per step
    acceptance_counts: list[int]  # summed spec_token_acceptance_counts, positions 0..k
    mean_acceptance_length: float  # tau, bonus included
    acceptance_rate: float  # accepted / proposed (nan when nothing was proposed)
    acceptance_per_position: list[float]  # counts[i+1] / counts[0]
    system_efficiency: float  # emitted / (steps * (k+1))
    mean_step_time_s: dict[str, float] = msgspec.field(default_factory=dict)  # phase -> mean seconds


def record_acceptance(counts: list[int], num_accepted: int) -> None:
    """Record one decode step that accepted ``num_accepted`` drafts in ``counts`` (spec_token_acceptance_counts,
    positions 0..k), in place: position 0 counts every step, position i the steps that accepted draft i. The one
    definition for the step loop and for offline replay. A step that accepted more drafts than ``counts`` has
    positions for (a tree whose proposer under-reported TreeProposer.tree_max_path) grows it: an accepted draft is
    never dropped from the figures."""
    counts[0] += 1
    if num_accepted >= len(counts):
        counts.extend([0] * (num_accepted + 1 - len(counts)))
    for i in range(num_accepted):
        counts[i + 1] += 1


def record_chosen(metrics: RequestMetrics, num_proposed: int, num_chosen: int) -> None:
    """Record one decode step's drafted tokens and the policy's chosen k (or tree budget) in a request's metrics."""
    metrics.num_draft_tokens += num_proposed
    hist = metrics.chosen_k_counts
    if hist is None:
        hist = metrics.chosen_k_counts = []
    if num_chosen >= len(hist):
        hist.extend([0] * (num_chosen + 1 - len(hist)))
    hist[num_chosen] += 1


def sum_counts(counts_list: list[list[int]]) -> list[int]:
    width = max((len(c) for c in counts_list), default=1)
    total = [0] * width
    for counts in counts_list:
        for i, c in enumerate(counts):
            total[i] += c
    return total


def tau(counts: list[int]) -> float:
    return sum(counts) / counts[0] if counts and counts[0] else float("nan")


def per_position(counts: list[int]) -> list[float]:
    return [c / counts[0] for c in counts[1:]] if counts and counts[0] else []


class StepTimeStats:
    """Running statistics of per-step phase timings (phase -> seconds, e.g. propose/score/verify/step):
    count, total, min and max per phase, O(1) memory however many steps run."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.total: dict[str, float] = {}
        self.min: dict[str, float] = {}
        self.max: dict[str, float] = {}

    def add(self, times: dict[str, float]) -> None:
        for name, sec in times.items():
            self.count[name] = self.count.get(name, 0) + 1
            self.total[name] = self.total.get(name, 0.0) + sec
            self.min[name] = min(self.min.get(name, sec), sec)
            self.max[name] = max(self.max.get(name, sec), sec)

    def means(self) -> dict[str, float]:
        return {n: self.total[n] / c for n, c in self.count.items()}


def aggregate_metrics(
    metrics: list[RequestMetrics],
    num_draft_tokens: int | None = None,
    step_times: list[dict[str, float]] | StepTimeStats | None = None,
) -> SpecDecodeMetrics:
    """Aggregate per-request counters. ``num_draft_tokens`` defaults to steps * k (every step speculated)."""
    counts = sum_counts([m.spec_token_acceptance_counts or [0] for m in metrics])
    if not isinstance(step_times, StepTimeStats):
        stats = StepTimeStats()
        for st in step_times or []:
            stats.add(st)
        step_times = stats
    return aggregate_counts(counts, num_draft_tokens, step_times.means())


def aggregate_counts(counts: list[int], num_draft_tokens: int | None = None,
                     mean_step_time_s: dict[str, float] | None = None) -> SpecDecodeMetrics:
    """The metrics of summed ``spec_token_acceptance_counts`` (see the module docstring)."""
    counts = counts or [0]
    k = len(counts) - 1
    steps = counts[0]
    accepted = sum(counts[1:])
    drafts = steps * k if num_draft_tokens is None else num_draft_tokens
    emitted = steps + accepted
    return SpecDecodeMetrics(
        num_steps=steps,
        num_draft_tokens=drafts,
        num_accepted_tokens=accepted,
        num_emitted_tokens=emitted,
        acceptance_counts=list(counts),
        mean_acceptance_length=tau(counts),
        acceptance_rate=accepted / drafts if drafts else float("nan"),
        acceptance_per_position=per_position(counts),
        system_efficiency=emitted / (steps * (k + 1)) if steps else float("nan"),
        mean_step_time_s=dict(mean_step_time_s or {}),
    )


class SpecStepStats(msgspec.Struct, kw_only=True):
    """One decode step's speculative counters over its batch (0 everywhere for a plain step)."""

    num_drafts: int = 0  # requests that got a proposal
    num_draft_tokens: int = 0  # draft tokens proposed
    num_accepted_tokens: int = 0  # draft tokens accepted
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)  # [k] accepted at position i

    @classmethod
    def of(cls, outputs: Sequence) -> "SpecStepStats":
        """From a step's ``GroupStepOutput``s (their num_proposed / num_accepted)."""
        k = max((o.num_proposed for o in outputs), default=0)
        per_pos = [0] * k
        for o in outputs:
            for i in range(min(o.num_accepted, k)):
                per_pos[i] += 1
        return cls(num_drafts=sum(1 for o in outputs if o.num_proposed), num_draft_tokens=sum(o.num_proposed for o in outputs),
                   num_accepted_tokens=sum(o.num_accepted for o in outputs), num_accepted_tokens_per_pos=per_pos)


class LatencyStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's latencies in seconds (None where the request never got that far)."""

    ttft: float | None = None  # time to first token: first_token_time - arrival_time
    tpot: float | None = None  # time per output token after the first
    e2e: float | None = None  # finished_time - arrival_time
    queue: float | None = None  # time_in_queue
    itl: list[float] = msgspec.field(default_factory=list)  # gaps between emissions, when recorded


def latency_stats(metrics: RequestMetrics | None, num_output_tokens: int | None = None,
                  emission_times: Sequence[float] | None = None) -> LatencyStats:
    """TTFT, TPOT, end-to-end and ITL of one request, from its RequestMetrics (pure).

    ``num_output_tokens`` is needed for TPOT; ``emission_times`` (time.time() of each step that emitted
    tokens, the first included) for ITL: the engine core's front end records them, RequestMetrics does not."""
    if metrics is None:
        return LatencyStats()
    first, done = metrics.first_token_time, metrics.finished_time
    ttft = None if first is None else first - metrics.arrival_time
    e2e = None if done is None else done - metrics.arrival_time
    tpot = None
    if first is not None and num_output_tokens and num_output_tokens > 1:
        end = done if done is not None else metrics.last_token_time
        tpot = (end - first) / (num_output_tokens - 1)
    times = list(emission_times or [])
    itl = [b - a for a, b in zip(times, times[1:])]
    return LatencyStats(ttft=ttft, tpot=tpot, e2e=e2e, queue=metrics.time_in_queue, itl=itl)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """{"p50": ..., "p99": ...} by linear interpolation (NaN for no values)."""
    xs = sorted(values)
    out = {}
    for q in qs:
        if not xs:
            out[f"p{q:g}"] = float("nan")
            continue
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q:g}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out
