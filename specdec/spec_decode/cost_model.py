"""The engine's cost table for the speculation policy: what a step costs as a function of what it proposes.

Seconds of one speculative step = ``forward(rows, B)`` + ``draft(sum_k, drafting rows)`` + B x ``overhead``:
- ``forward(rows, B)``: the target forward over ``rows`` scored tokens of a batch of B sequences (B pending tokens
  + every row's draft nodes) = ``base(rows)`` + ``offset(B)``. ``base`` is one sequence's forward, linear
  interpolation between measured points (beyond the last point: extrapolated along the last segment), measured at
  start-up by :func:`calibrate` (forwards of every width to 8 rows, then 12, 16, 32, 64, in one scratch slot after a
  short prefix, the fastest of ``reps`` after a warm-up call, made non-decreasing); its shape is not refreshed.
  ``offset(B)`` is what a live step of B sequences costs beyond ``base`` of the same rows (the live context's
  attention, the tree mask, per-sequence bookkeeping, whatever the start-up table misses under today's load): an
  EMA per B of live ``score - base(rows)``, started for B = 2, 4, 8, 16 from start-up measurements (B sequences of 2 rows, as many as
  free slots allow) and for B = 1 from 0; interpolated between known B, per sequence past the largest. One level
  per B, not a point per row count: a policy that keeps choosing one width refreshed only that point, which then
  carried the live context's cost while its neighbours kept the start-up prefix's, and the step between them read
  as the price of one more node (eagle3_ngram at batch 1 over Spec-Bench: 7 rows learnt 51.9 ms beside 37.3 ms
  at 6, so the goodput policy cut the tree's last node in translation, where it is accepted 41% of the time);
- ``draft``: ``per_token`` seconds per chosen draft token (a chain) or ``per_row`` seconds per drafting row (a
  tree: its cost is the depth's forwards whatever the budget), EMAs of the live propose phase of steady steps (the
  worker leaves out a step where a row drafts for the first time since its prompt or since steps at 0: its
  proposer's catch-up over those tokens is not what a step of drafting costs);
- ``overhead``: the verify phase (rejection sampling, KV rollback, bookkeeping) per sequence, an EMA of the live
  one over B: it grows with the batch (eagle3_ngram at B = 12: a step of one draft token took 112-123 ms where a
  constant overhead learnt at small batches priced it at 88-99, below the 92 ms plain step);
- ``ctx_slope``: seconds per drafted row per token of its sequence's context, measured at start-up (the table again
  after a long prefix): a drafted row's attention reads its whole context, so at long contexts a row costs more than
  the table (taken after a short prefix) says. On the 2-core Zen 4 box, bf16: 230-400 ns per row and token, so a
  row after 768 tokens costs 0.17-0.30 ms more than after 32, beside a ~9 ms one-token forward; priced here, the
  policy drafts less on long prompts (n-gram on Spec-Bench's rag and summarization), and the level ``offset`` no
  longer carries the last request's context into the next one's first steps. The caller adds ``ctx_slope *
  context`` per drafted row (``context_seconds``).

A step where every row drafts nothing may run the plain worker instead (SpecDecodeWorker._plain_decode: no
proposer, padding or verification). Its seconds are kept apart, per batch size (``plain``: an EMA of live plain
steps), and price S = 0 when the caller says the step would go plain; a batch size never seen on that path is
priced as a speculative step of no drafts. They do not touch the speculative tables above.

Pure Python on short lists: ``step_seconds`` is called for every candidate size each step (policy.py's budget
of 2% of a one-token forward). Knows nothing about proposers, requests or acceptance.
"""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path

import torch

# Row counts measured at start-up: the widths a chain (k+1), a tree (budget+1) or a batch's step scores. Every
# width to 8: the forward's cost is not linear there (the kernels' row blocks: on a 2-core AVX2 box 4 -> 8 rows
# cost 33 -> 41 ms with a step at 7), and a policy never refreshes a width it never chooses, so an interpolated
# point can hold it off for good. 12 points x (1 warm-up + 2 reps) of a 135M model: ~3 s on 2 cores.
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)


class CostModel:
    """Seconds of a step as a function of its rows (module docstring). ``ema``: weight of a new measurement."""

    def __init__(self, points: dict[int, float] | None = None, per_token: float = 0.0, per_row: float = 0.0,
                 overhead: float = 0.0, ema: float = 0.1, ctx_slope: float = 0.0) -> None:
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"CostModel: ema={ema} must be in (0, 1] (the weight of each new step time)")
        self.rows: list[int] = []  # ascending row counts with a measured forward time
        self.secs: list[float] = []  # [len(rows)] seconds of a forward over that many rows
        for r, s in sorted((points or {}).items()):
            self.rows.append(int(r))
            self.secs.append(float(s))
        self.per_token, self.per_row, self.overhead, self.ema = per_token, per_row, overhead, ema
        if not ctx_slope >= 0.0:
            raise ValueError(f"CostModel: ctx_slope={ctx_slope} must be >= 0 (seconds per drafted row per context token)")
        self.ctx_slope = float(ctx_slope)
        self.offsets: dict[int, float] = {}  # batch size B -> EMA of live score seconds - base(rows)
        self.plain: dict[int, float] = {}  # batch size B -> EMA of a live plain step's seconds (module docstring)

    # ------------------------------------------------------------------ the model
    @property
    def calibrated(self) -> bool:
        """At least two measured widths: enough to tell what one more row costs."""
        return len(self.rows) >= 2

    def forward(self, rows: int, batch: int = 1) -> float:
        """Seconds of a target forward over ``rows`` tokens of ``batch`` sequences. 0 when nothing was measured."""
        return self.base(rows) + self.offset(batch)

    def offset(self, batch: int) -> float:
        """What a live step of ``batch`` sequences costs beyond ``base`` of the same rows: learnt, else interpolated
        between learnt batch sizes (B = 1 at 0 until learnt), per sequence past the largest."""
        off = self.offsets
        if batch in off:
            return off[batch]
        lo = max((b for b in off if b < batch), default=1)
        hi = min((b for b in off if b > batch), default=None)
        y0 = off.get(lo, 0.0)
        if hi is None:
            # past the largest batch seen: per sequence beyond the first (only B = 1 known: its level)
            return y0 * (batch - 1) / (lo - 1) if lo > 1 else y0
        return y0 + (off[hi] - y0) * (batch - lo) / (hi - lo)

    def step_curve(self, batch: int, max_extra: int, per_draft_token: bool, plain: bool = False) -> list[float]:
        """[max_extra + 1] step seconds of ``batch`` sequences with S = 0..max_extra draft tokens in all, without
        the per-row draft cost (a tree's: the caller adds ``per_row`` per drafting row). One walk over the table:
        the policy's hot path. ``plain``: S = 0 runs the plain worker (its measured seconds, when known)."""
        out = self._curve(batch, max_extra, per_draft_token)
        if plain and batch in self.plain:
            out[0] = self.plain[batch]
        return out

    def _curve(self, batch: int, max_extra: int, per_draft_token: bool) -> list[float]:
        fixed = self.overhead * batch + self.offset(batch)
        tok = self.per_token if per_draft_token else 0.0
        xs, ys = self.rows, self.secs
        if len(xs) < 2:
            return [self.base(batch + S) + fixed + tok * S for S in range(max_extra + 1)]
        out, i, last = [], 1, len(xs) - 1
        for S in range(max_extra + 1):
            r = batch + S
            while i < last and r > xs[i]:  # the segment [i-1, i] holding r (the last one past the table)
                i += 1
            x0, y0 = xs[i - 1], ys[i - 1]
            y = y0 + (ys[i] - y0) * (r - x0) / (xs[i] - x0)
            out.append((y if y > 0 else 0.0) + fixed + tok * S)
        return out

    def base(self, rows: int) -> float:
        """Seconds of one sequence's forward over ``rows`` tokens."""
        xs, ys = self.rows, self.secs
        if not xs:
            return 0.0
        if len(xs) == 1:
            return ys[0] * max(rows, 1) / xs[0] if rows > xs[0] else ys[0]
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return ys[i]
        i = min(max(i, 1), len(xs) - 1)  # the segment [i-1, i]; outside the table: the nearest one, extended
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 0.0)

    def context_seconds(self, row_contexts: int) -> float:
        """What drafted rows cost beyond the table for their contexts: ``row_contexts`` = the sum over drafted rows of
        their sequence's tokens."""
        return self.ctx_slope * row_contexts

    def step_seconds(self, rows: int, batch: int, draft_tokens: int, drafting_rows: int) -> float:
        """A whole step: forward over ``rows`` of ``batch`` sequences + drafting ``draft_tokens`` over
        ``drafting_rows`` + overhead (per sequence)."""
        return (self.forward(rows, batch) + self.per_token * draft_tokens + self.per_row * drafting_rows
                + self.overhead * batch)

    # ------------------------------------------------------------------ live refresh
    def observe(self, rows: int, batch: int, score_s: float, propose_s: float, verify_s: float, draft_tokens: int,
                drafting_rows: int, row_contexts: int = 0) -> None:
        """One live step: its scored rows, batch size and phase seconds (SpecDecodeWorker's ``times``);
        ``row_contexts``: the sum of the drafted rows' context lengths (their price beyond the table is not level)."""
        a = self.ema
        self.observe_forward(rows, batch, score_s - self.context_seconds(row_contexts))
        # the first sample is taken whole (0 = never observed): from 0 the EMA priced drafting at a tenth of its cost
        # on the first step, and took ~20 steps to reach 90% of it
        if draft_tokens:
            self.per_token = _ema_from_first(self.per_token, propose_s / draft_tokens, a)
        if drafting_rows:
            self.per_row = _ema_from_first(self.per_row, propose_s / drafting_rows, a)
        self.overhead += a * (verify_s / max(batch, 1) - self.overhead)

    def observe_forward(self, rows: int, batch: int, seconds: float) -> None:
        """One live target forward over ``rows`` tokens of ``batch`` sequences (a speculative step's score phase)."""
        a = self.ema
        if len(self.rows) < 2:  # no shape to learn a level against yet (no start-up table): one sequence's points
            if batch == 1 and rows not in self.rows:
                i = bisect.bisect_left(self.rows, rows)
                self.rows.insert(i, rows)
                self.secs.insert(i, seconds)
            return
        # a new batch size starts from what the table predicted there, so one step slowed by another process moves
        # it by ``ema`` only
        old = self.offsets.get(batch, self.offset(batch))
        self.offsets[batch] = old + a * (seconds - self.base(rows) - old)

    def observe_plain(self, batch: int, seconds: float) -> None:
        """One live step of ``batch`` sequences that ran the plain worker (every row at 0 drafts)."""
        old = self.plain.get(batch)
        self.plain[batch] = seconds if old is None else old + self.ema * (seconds - old)

    # ------------------------------------------------------------------ persistence (replay reads it)
    def to_dict(self) -> dict:
        return {"forward_s": {str(r): s for r, s in zip(self.rows, self.secs)}, "per_token_s": self.per_token,
                "per_row_s": self.per_row, "overhead_per_seq_s": self.overhead,
                "batch_offset_s": {str(b): v for b, v in sorted(self.offsets.items())},
                "plain_step_s": {str(b): v for b, v in sorted(self.plain.items())}, "ctx_slope_s": self.ctx_slope}

    @classmethod
    def from_dict(cls, d: dict, ema: float = 0.1) -> "CostModel":
        cm = cls({int(r): float(s) for r, s in d.get("forward_s", {}).items()}, d.get("per_token_s", 0.0),
                 d.get("per_row_s", 0.0), d.get("overhead_per_seq_s", d.get("overhead_s", 0.0)), ema,
                 d.get("ctx_slope_s", 0.0))
        cm.offsets = {int(b): float(v) for b, v in d.get("batch_offset_s", {}).items()}
        cm.plain = {int(b): float(v) for b, v in d.get("plain_step_s", {}).items()}
        return cm

    def save(self, path: str | Path, made_on: dict | None = None) -> None:
        """The table as JSON; ``made_on`` (cost_table_key: the engine it was measured on) goes with it."""
        d = self.to_dict() if made_on is None else {**self.to_dict(), "made_on": made_on}
        Path(path).write_text(json.dumps(d, indent=2))

    @classmethod
    def load(cls, path: str | Path, ema: float = 0.1, made_on: dict | None = None) -> "CostModel":
        """The table saved at ``path``; with ``made_on``, refused when it says it was measured on another engine (a
        tiny model's table priced SmolLM2's forwards at 0.3 ms and the policy chose accordingly, without a word)."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"CostModel.load: no cost table at {p}; calibrate one (policy option "
                                    "cost_table=<path> writes it on the first speculative step)")
        d = json.loads(p.read_text())
        saved = d.get("made_on")
        if made_on is not None and saved is not None:  # a table written by hand (no made_on) is taken as given
            differ = {k: (saved.get(k), v) for k, v in made_on.items() if saved.get(k) != v}
            if differ:
                what = ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
                raise MismatchedTable(f"cost table {p} was measured on another engine ({what}); delete it or point "
                                      "cost_table at a new path to keep this engine's")
        return cls.from_dict(d, ema)


class MismatchedTable(ValueError):
    """A saved cost table measured on another engine (CostModel.load with ``made_on``)."""


def _ema_from_first(old: float, x: float, a: float) -> float:
    """``old`` moved by ``a`` of the way to ``x``; ``x`` itself where ``old`` is 0 (never observed)."""
    return x if old == 0.0 else old + a * (x - old)


def non_decreasing(xs: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``xs`` (pool adjacent violators: a run that falls is replaced by its
    mean) [n] -> [n]. The start-up table goes through it: a forward over more rows never costs less, and the
    table's shape is not refreshed live, so one point timed low (a 2-core box: 6 rows at 34.8 ms beside 5 at 35.9)
    would price a node below zero for good. policy.decreasing_envelope is its mirror image."""
    blocks: list[list[float]] = []  # [sum, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-1][0] / blocks[-1][1] < blocks[-2][0] / blocks[-2][1]:
            t, c = blocks.pop()
            blocks[-1][0] += t
            blocks[-1][1] += c
    return [t / c for t, c in blocks for _ in range(c)]


CALIBRATION_LONG_PREFIX = 512  # the context after which the table's rows are timed again (ctx_slope)
CALIBRATION_BATCHES = (2, 4, 8, 16)  # batch sizes whose offset is measured at start-up (as many as free slots allow)
_CACHE: dict[int, CostModel] = {}  # id(engine) -> its start-up measurement (one calibration per engine)


def _timed_once(engine, toks: torch.Tensor, slots: list[int], r: int, pre: int) -> float:
    """Seconds of one forward of ``r`` rows in each of ``slots`` after ``pre`` tokens (each rolled back to ``pre``)."""
    from specdec.engine import ForwardBatch

    for s in slots:
        engine.rollback(s, pre)
    t0 = time.perf_counter()
    engine.forward(ForwardBatch(token_ids=toks[pre: pre + r].repeat(len(slots)).to(engine.device), slots=slots,
                                query_lens=[r] * len(slots), logit_stats=True))
    return time.perf_counter() - t0


def cost_table_key(engine) -> dict:
    """What a cost table's figures depend on: the target's shape and dtype, the kernels, the CPU, the threads."""
    from specdec.engine.cpu.threads import governor

    key = {"vocab_size": engine.vocab_size, "hidden_size": getattr(engine, "hidden_size", None),
           "num_layers": getattr(engine, "num_layers", None),
           "threads": governor().full}  # the configured count (the governor lowers torch's while cores are taken)
    describe = getattr(engine, "describe", None)
    return {**key, **(describe() if callable(describe) else {})}


def calibrate(engine, rows: tuple[int, ...] = CALIBRATION_ROWS, batches: tuple[int, ...] = CALIBRATION_BATCHES,
              prefix: int = 32, reps: int = 2, long_prefix: int = CALIBRATION_LONG_PREFIX, rounds: int = 4,
              cache: bool = True) -> CostModel:
    """A CostModel measured on ``engine``, in scratch KV slots after a ``prefix``-token context: one sequence's forward
    at each row count (a warm-up call each, then the fastest of ``rounds`` passes over the widths), and the offset of B
    sequences of 2 rows each (a k = 1 chain) for each B the free slots allow (the fastest of ``reps`` after one
    warm-up call); then 1 and 8 rows after ``long_prefix`` tokens (as many as the engine's context allows, when that
    is 4x ``prefix`` or more): what the 7 rows between cost more there than after ``prefix``, per row and context
    token, is ``ctx_slope`` (0 when not measured or not positive). Uncalibrated (no points) when no slot is free.
    Cached per engine object (``cache=False``: measured afresh and not kept, e.g. at another ``prefix``)."""
    if cache and id(engine) in _CACHE:
        return CostModel.from_dict(_CACHE[id(engine)].to_dict())
    rows = tuple(r for r in rows if prefix + r <= engine.max_model_len)
    free = engine.num_free_slots()
    if free < 1 or len(rows) < 2:
        return CostModel()
    from specdec.engine import ForwardBatch

    slots = [engine.allocate_slot() for _ in range(min(free, max(batches, default=1)))]
    dev = engine.device
    long = min(long_prefix, engine.max_model_len - 8)
    toks = (torch.arange(1, max(prefix + max(rows), long + 8) + 1, dtype=torch.long) % max(engine.vocab_size - 1, 1)
            + 1)

    def timed(use: list[int], r: int) -> float:  # the first call of a width is a warm-up (71 vs 43 ms at 8 rows)
        _timed_once(engine, toks, use, r, prefix)
        return min(_timed_once(engine, toks, use, r, prefix) for _ in range(reps))

    try:
        for s in slots:  # the context, one prefill per slot (its last row's logits only)
            engine.forward(ForwardBatch(token_ids=toks[:prefix].to(dev), slots=[s], query_lens=[prefix],
                                        logits_indices=torch.tensor([prefix - 1], device=dev)))
        # one sequence's widths in rounds (a warm-up call each, then ``rounds`` passes over every width, the fastest
        # per width): the machine's drift hits every width alike, where width after width it made steps in the table
        # (a noisy 2-core Zen 4 host: the goodput policy then cut the EAGLE-3 tree's last nodes, tau 2.42 -> 2.31)
        for r in rows:
            _timed_once(engine, toks, slots[:1], r, prefix)
        best = [min(t) for t in zip(*([_timed_once(engine, toks, slots[:1], r, prefix) for r in rows]
                                      for _ in range(rounds)))]
        cost = CostModel(dict(zip(rows, non_decreasing(best))))
        for b in batches:
            if b <= len(slots):
                cost.offsets[b] = timed(slots[:b], 2) - cost.base(2 * b)
        if long >= 4 * prefix:  # 1 and 8 rows after a long context, then after the short one again (its first
            s0 = slots[0]  # tokens are the same), best of 4 each: a ~1 ms difference between ~10 ms forwards
            engine.rollback(s0, 0)
            engine.forward(ForwardBatch(token_ids=toks[:long].to(dev), slots=[s0], query_lens=[long],
                                        logits_indices=torch.tensor([long - 1], device=dev)))
            d = {(pre, r): min(_timed_once(engine, toks, [s0], r, pre) for _ in range(max(reps, 4)))
                 for pre in (long, prefix) for r in (1, 8)}
            extra = (d[long, 8] - d[long, 1]) - (d[prefix, 8] - d[prefix, 1])
            cost.ctx_slope = max(extra, 0.0) / (7 * (long - prefix))
    finally:
        for s in slots:
            engine.free_slot(s)
    if cache:
        _CACHE[id(engine)] = cost
    return CostModel.from_dict(cost.to_dict())
