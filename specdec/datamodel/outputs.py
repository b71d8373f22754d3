"""What `LLM.generate` returns (vLLM-like). Plain data; knows nothing about models or scheduling."""

from __future__ import annotations

import msgspec

from specdec.datamodel.metrics import LatencyStats
from specdec.datamodel.sequence import Logprob, RequestMetrics


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int  # which completion of the request (0..n-1)
    text: str  # detokenised output, special tokens skipped
    token_ids: list[int]  # generated ids, a stop/EOS token included when one ended the request
    cumulative_logprob: float | None  # sum of the emitted tokens' logprobs (raw logits)
    logprobs: list[dict[int, Logprob]] | None  # per emitted token, when SamplingParams.logprobs is set
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | 'error' | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None  # the prompt text when one was given
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request ended early (bad prompt, NaN logits): value + way out
    # TTFT, TPOT, end-to-end and ITL in seconds, derived from metrics (specdec.datamodel.metrics.latency_stats)
    latency: LatencyStats | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token, when asked for
