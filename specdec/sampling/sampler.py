"""Plain (non-speculative) sampling: one token per row from [B, V] logits, per-request parameters.

Also the pieces the verifiers reuse: :class:`SamplingTensors` (per-request parameters as [N] tensors,
expandable per scored token) and :func:`logits_to_probs` (temperature, top-k, top-p, min-p; greedy rows
become a one-hot argmax). Knows nothing about speculation, models or request state: the caller owns the
per-request ``torch.Generator`` objects (built from ``SamplingParams.seed``).

Conventions:
- greedy (temperature 0) = ``torch.argmax`` of the raw logits (ties -> lowest index);
- random rows sample ``norm(probs)`` by the exponential race ``argmax(probs / Exp(1))``; rows with a
  generator draw their noise from it, so their token depends only on their logits and their seed;
- logits processors (penalties, logit_bias, allowed/bad tokens, min_tokens: specdec/sampling/logits_process.py)
  run first, on the rows that ask for them, when the caller passes each row's sequence (``seq_data``); then
  ``allowed`` (a grammar's mask, specdec/sampling/guided.py) masks the rest; a row left with no token is
  reported in ``SamplerOutput.no_token`` (its token is meaningless);
- ``logprobs`` are log_softmax of the RAW logits (before processors, temperature and filters), as vLLM
  returns them by default (its ``raw_logprobs`` mode);
- a row whose logits contain NaN or +-inf is *not finite*: token -1, logprob NaN, and it never touches the
  other rows (use a large negative finite value, not -inf, to mask a token before this sampler; a row of
  finite logits whose sum overflows float32, |logit| ~ 1e34, also counts as not finite).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec_kernels import get_ops
from specdec_kernels.noise import draw_exponential
from specdec.sampling.logits_process import MASKED, active_processor_fields, apply_processors
from specdec.datamodel.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingTensors", "argmax_last", "logits_to_probs", "make_generators"]


def argmax_last(x: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...] int64
    """``torch.argmax(x, dim=-1)``, the same indices (the first maximum; a NaN counts as the maximum, the first
    NaN wins), through numpy for CPU float32/64 tensors: on a [1, 7, 49152] score torch's CPU argmax took
    250-380 us on the 2-core box, numpy's vectorised one ~45 us (experiments/bench/step_ops.py); greedy
    verification takes one per step."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad or x.numel() == 0:
        return x.argmax(dim=-1)
    return torch.from_numpy(x.contiguous().numpy().argmax(-1)).to(torch.int64)


def make_generators(params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> list[torch.Generator | None]:
    """One generator per request: seeded from ``params.seed``, None where no seed is set."""
    return [None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed) for p in params]


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors; a filter that is off for every row is None (skipped)."""

    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor | None  # [N] int64, 0 = off
    top_p: torch.Tensor | None  # [N] float32, 1 = off
    min_p: torch.Tensor | None  # [N] float32, 0 = off
    all_greedy: bool  # every row has temperature 0
    all_random: bool  # no row has temperature 0

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> "SamplingTensors":
        if not params:
            raise ValueError("SamplingTensors.from_params: got no SamplingParams (a batch needs >= 1 row).")
        greedy = [p.temperature == 0.0 for p in params]
        # a filter only counts on random rows: greedy rows ignore it
        top_k = [max(p.top_k, 0) if not g else 0 for p, g in zip(params, greedy)]
        top_p = [p.top_p if not g else 1.0 for p, g in zip(params, greedy)]
        min_p = [p.min_p if not g else 0.0 for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor([float(p.temperature) for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if any(top_k) else None,
            top_p=(torch.tensor(top_p, dtype=torch.float32, device=device)
                   if any(v < 1.0 for v in top_p) else None),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if any(min_p) else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )

    def expand(self, num_tokens: int, kernel: str = "torch") -> "SamplingTensors":
        """Every row repeated ``num_tokens`` times: [B] -> [B * num_tokens], e.g. k+1 scored positions."""
        expand = get_ops(kernel).expand_per_token

        def ex(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else expand(t, num_tokens)

        return replace(self, temperature=ex(self.temperature), top_k=ex(self.top_k), top_p=ex(self.top_p),
                       min_p=ex(self.min_p))

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        """The rows ``rows`` ([M] int64); flags are kept (still true of any subset)."""

        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, rows)

        return replace(self, temperature=sel(self.temperature), top_k=sel(self.top_k), top_p=sel(self.top_p),
                       min_p=sel(self.min_p))

    def to_probs(self, logits: torch.Tensor, kernel: str = "torch") -> torch.Tensor:
        """[N, V] logits -> [N, V] float32 probabilities (see :func:`logits_to_probs`)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p,
                               greedy_rows=not self.all_random, kernel=kernel)


def logits_to_probs(logits: torch.Tensor,  # [N, V] float
                    temperature: torch.Tensor,  # [N] float, 0 = greedy
                    top_k: torch.Tensor | None = None,  # [N] int64, <= 0 = off; None = off for all
                    top_p: torch.Tensor | None = None,  # [N] float, 1 = off; None = off for all
                    min_p: torch.Tensor | None = None,  # [N] float, 0 = off; None = off for all
                    *, greedy_rows: bool = True,  # False: promise no row is greedy (skips the one-hot)
                    kernel: str = "torch") -> torch.Tensor:  # [N, V] float32
    """The distribution each row samples from: softmax(filtered(logits / T)); greedy rows -> one-hot argmax."""
    ops = get_ops(kernel)
    x = ops.apply_temperature(logits.to(torch.float32), temperature)
    if top_k is not None or top_p is not None:
        x = ops.apply_top_k_top_p(x, top_k, top_p)
    if min_p is not None:
        x = ops.apply_min_p(x, min_p)
    probs = x.softmax(dim=-1)
    if greedy_rows:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where((temperature == 0)[:, None], one_hot, probs)
    return probs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, -1 for rows that are not finite
    logprobs: torch.Tensor  # [B] float32 log_softmax(raw logits)[token]; NaN for rows not finite
    # (ids [B, n] int64, values [B, n] float32): the n = max(params.logprobs) most likely tokens under
    # log_softmax(raw logits); None when no request asked for logprobs
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None
    finite: torch.Tensor  # [B] bool: False where the row's logits had NaN or +-inf
    no_token: torch.Tensor | None = None  # [B] bool, with ``allowed``: True where the masks left no token


class Sampler:
    """Samples one token per row. ``Sampler()(logits [B, V], params, generators) -> SamplerOutput``."""

    def __init__(self, kernel: str = "torch"):
        get_ops(kernel)  # fail now on an unknown backend
        self.kernel = kernel

    def __call__(self, logits: torch.Tensor,  # [B, V] float32
                 params: Sequence[SamplingParams],  # [B]
                 generators: Sequence[torch.Generator | None] | None = None,  # [B], None = unseeded
                 seq_data: Sequence | None = None,  # [B] each row's SequenceData (its prefix), for processors
                 allowed: torch.Tensor | None = None,  # [B, V] bool: False = a grammar forbids it; None = all
                 stats=None,  # specdec.engine.interface.LogitStats of ``logits`` (current_stats checked), or None
                 ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"Sampler: logits have shape {tuple(logits.shape)} for {len(params)} "
                             f"SamplingParams; expected [{len(params)}, vocab_size].")
        B, V = logits.shape
        logits = logits.to(torch.float32)
        if stats is not None and not stats.valid_for(logits):
            stats = None  # they describe another tensor (or these logits before an edit): read the logits
        # a row is finite iff its sum is (NaN and +-inf propagate); 20x cheaper than isfinite().all(). The engine's
        # statistics, taken as it wrote the rows, say the same without another pass over [B, V] (at B = 16 the
        # passes below cost ~0.8 ms of a ~20 ms plain step: logsumexp alone 0.66)
        finite = torch.isfinite(logits.sum(dim=-1)) if stats is None else stats.finite.to(logits.device)  # [B]
        all_finite = bool(finite.all())
        if not all_finite:  # neutralise bad rows so that nothing below sees NaN/inf
            logits = torch.where(finite[:, None], logits, torch.zeros((), dtype=logits.dtype))
        raw = logits  # [B, V] what logprobs are reported under
        if any(active_processor_fields(p) for p in params):
            if seq_data is None:
                raise ValueError("Sampler: a request has logits processors on (penalties, logit_bias, ...) but no "
                                 "seq_data was passed; pass each row's SequenceData so they see its prefix")
            logits = apply_processors(raw, [d.get_token_ids() for d in seq_data],
                                      [d.get_prompt_len() for d in seq_data], params)  # [B, V]
        no_token = None
        if allowed is not None:
            logits = logits.masked_fill(~allowed.to(logits.device), MASKED)
            no_token = logits.amax(-1) <= MASKED / 2  # [B]
        if stats is None:
            lse = torch.logsumexp(raw, dim=-1)  # [B]
            argmax = argmax_last(logits)  # [B]
        else:  # a row that is not finite has them unset: its outputs are masked below
            lse = stats.lse.to(logits.device, torch.float32)  # [B] of the raw rows
            argmax = (stats.argmax.to(logits.device, torch.int64) if logits is raw  # no processor, no mask
                      else argmax_last(logits))
            if not all_finite:
                argmax = torch.where(finite, argmax, 0)

        st = SamplingTensors.from_params(params, device=logits.device)
        if st.all_greedy:
            token_ids = argmax
        else:
            probs = st.to_probs(logits, kernel=self.kernel)  # greedy rows are one-hot
            greedy = [p.temperature == 0.0 for p in params]
            # greedy rows never advance their generator
            gens = None if generators is None else [None if g else gen for g, gen in zip(greedy, generators)]
            noise = draw_exponential(B, V, gens, device=logits.device)
            token_ids = (probs / noise).argmax(dim=-1)
            if not st.all_random:
                token_ids = torch.where(st.temperature == 0, argmax, token_ids)
        logprobs = raw.gather(-1, token_ids[:, None]).squeeze(-1) - lse

        top = None
        n = max((p.logprobs or 0) for p in params)
        if any(p.logprobs is not None for p in params):
            values, ids = raw.topk(min(n, V), dim=-1)  # [B, n]
            top = (ids, values - lse[:, None])
        if not all_finite:
            bad = ~finite
            token_ids = token_ids.masked_fill(bad, -1)
            logprobs = logprobs.masked_fill(bad, float("nan"))
            if top is not None:
                top = (top[0].masked_fill(bad[:, None], -1), top[1].masked_fill(bad[:, None], float("nan")))
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top, finite=finite, no_token=no_token)
