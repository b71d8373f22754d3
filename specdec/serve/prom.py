"""The server's Prometheus metrics (``GET /metrics``), one registry per app.

Requests: counts by endpoint and finish reason, prompt and generation tokens, TTFT / TPOT / end-to-end
latency histograms. The engine: running and waiting requests, core alive, restarts. Speculative decoding,
counted per engine step from ``SchedulerStats`` (names after vLLM's ``vllm:spec_decode_*``): drafts,
draft tokens, accepted tokens, accepted tokens per draft position (exported as vLLM's
``..._spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
``..._num_accepted_tokens_per_pos_total{position}``), and a histogram of the draft tokens each request got per
step (``specdec_spec_decode_draft_tokens_per_request``: what the speculation policy's k let the proposer draft;
0 = a prefill, or no speculation for it that step), beside a histogram of the speculation policy's own choice
per request per decode step (``specdec_spec_decode_num_chosen_tokens_per_request``: k, or a tree's node budget;
0 = the policy turned speculation off for that row; policy.py), from ``SchedulerStats.num_chosen_per_k``.
Knows nothing about HTTP routes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.datamodel.outputs import RequestOutput
from specdec.v1.protocol import EngineCoreOutput, SchedulerStats

_DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # k and tree budgets (config.MAX_SPECULATIVE_TOKENS = 64)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, {"model_name": model_name}
        self.labels = lab
        self.requests = Counter("specdec_requests", "Finished requests", ["model_name", "endpoint", "finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens", ["model_name"], registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Time per output token after the first",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Arrival to finish", ["model_name"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("specdec_num_requests_running", "Requests in the engine's batch", ["model_name"], registry=r)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests queued in the engine", ["model_name"], registry=r)
        self.core_alive = Gauge("specdec_engine_core_alive", "1 while the engine core serves", ["model_name"], registry=r)
        self.restarts = Counter("specdec_engine_core_restarts", "Engine core restarts", ["model_name"], registry=r)
        self.steps = Counter("specdec_engine_steps", "Engine steps", ["model_name"], registry=r)
        self.step_seconds = Counter("specdec_engine_step_seconds", "Seconds the engine core spent in steps "
                                    "(busy share = its rate)", ["model_name"], registry=r)
        self.drafts = Counter("specdec_spec_decode_num_drafts", "Requests that got a proposal, summed over steps",
                              ["model_name"], registry=r)
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed", ["model_name"],
                                    registry=r)
        self.accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       ["model_name"], registry=r)
        self.accepted_per_pos = Counter("specdec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["model_name", "position"],
                                        registry=r)
        self.draft_tokens_per_request = Histogram(
            "specdec_spec_decode_draft_tokens_per_request", "Draft tokens a request got in one step (the speculation "
            "policy's k as drafted; 0 = not speculated that step)", ["model_name"], buckets=_DRAFT_BUCKETS, registry=r)
        self.chosen_tokens_per_request = Histogram(
            "specdec_spec_decode_num_chosen_tokens_per_request", "The speculation policy's k (a tree: node budget) "
            "for a request in one decode step (0 = no speculation for it that step)", ["model_name"],
            buckets=_DRAFT_BUCKETS, registry=r)

        for metric in (self.prompt_tokens, self.generation_tokens, self.running, self.waiting, self.core_alive,
                       self.restarts, self.steps, self.step_seconds, self.drafts, self.draft_tokens,
                       self.accepted_tokens):
            metric.labels(**lab)  # exported as 0 from the start, so a scraper's first reading is a number

    def on_step(self, stats: SchedulerStats, outputs: list[EngineCoreOutput]) -> None:
        """An engine step's stats (AsyncLLMEngine.stat_listeners)."""
        lab = self.labels
        self.running.labels(**lab).set(stats.num_running_reqs)
        self.waiting.labels(**lab).set(stats.num_waiting_reqs)
        if stats.step_time:
            self.steps.labels(**lab).inc()
            self.step_seconds.labels(**lab).inc(stats.step_time)
        if stats.num_draft_tokens:
            self.drafts.labels(**lab).inc(stats.num_drafts)
            self.draft_tokens.labels(**lab).inc(stats.num_draft_tokens)
            self.accepted_tokens.labels(**lab).inc(stats.num_accepted_tokens)
            for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
                self.accepted_per_pos.labels(position=str(pos), **lab).inc(n)
        chosen = self.chosen_tokens_per_request.labels(**lab)
        for k, n in enumerate(stats.num_chosen_per_k):
            for _ in range(n):  # one observation per row-step (n <= the batch size)
                chosen.observe(k)
        hist = self.draft_tokens_per_request.labels(**lab)
        for out in outputs:
            if out.new_token_ids:
                hist.observe(out.num_draft_tokens)

    def on_restart(self) -> None:
        """A new engine core runs nothing yet: the old core's running / waiting counts go (they would stay
        until its first step otherwise)."""
        self.running.labels(**self.labels).set(0)
        self.waiting.labels(**self.labels).set(0)

    def on_finished(self, endpoint: str, out: RequestOutput) -> None:
        lab = self.labels
        for comp in out.outputs:
            self.requests.labels(endpoint=endpoint, finish_reason=comp.finish_reason or "unknown", **lab).inc()
            self.generation_tokens.labels(**lab).inc(len(comp.token_ids))
        self.prompt_tokens.labels(**lab).inc(len(out.prompt_token_ids))
        lat = out.latency
        if lat is not None:
            for hist, v in ((self.ttft, lat.ttft), (self.tpot, lat.tpot), (self.e2e, lat.e2e)):
                if v is not None:
                    hist.labels(**lab).observe(v)

    def render(self, alive: bool, restarts: int) -> bytes:
        self.core_alive.labels(**self.labels).set(1 if alive else 0)
        c = self.restarts.labels(**self.labels)
        c.inc(max(0, restarts - c._value.get()))
        return generate_latest(self.registry)
