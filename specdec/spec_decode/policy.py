"""Speculation policies: how much each request drafts this step (speculative_config ``speculation_policy``).

Every speculative step the worker asks ``policy.choose(batch view, cost model)`` for one number per request:
the draft length k (a chain) or the node budget (a tree), 0 = no speculation for that request this step,
never above the row's ``limit`` (the configured k or tree budget, the request's
``SamplingParams.num_speculative_tokens``, the room left before max_model_len); after the step it tells the
policy what happened (``observe``). Losslessness is untouched: the policy only decides how much to propose,
before anything is drafted, and Top1Proposer cuts each proposal to it (a chain: its first k; a tree: its first
``budget`` nodes in creation order, which is ancestor-closed because every node's parent comes before it).

Policies (``speculation_policy=...``, options in ``policy_options``):
- ``static``: the limit, every step (today's behaviour; the default);
- ``batch_size``: k from the batch size (vLLM's ``num_speculative_tokens_per_batch_size``): ``schedule`` =
  [[max batch, k], ...] ascending; a batch above the last entry does not speculate;
- ``acceptance_ema``: tiers (SGLang's adaptive speculation, 1/3/7): a per-request EMA of accepted drafts per
  step, and the smallest tier above it (one more draft than usually accepted);
- ``goodput``: maximises the step's expected emitted tokens per second (below).

Goodput. Request b's conditional acceptance at draft position i, ``alpha[b][i]``, is an EMA (weight ``ema``)
of its outcomes there (1 accepted, 0 the first rejection; positions past it, or past what was proposed, are
not observed), started from the batch-wide EMA of the same position (itself started at ``prior``). Drafting
k tokens then emits E_b(k) = 1 + sum_{i<=k} prod_{j<=i} alpha[b][j] tokens (specdec/experiment/theory.py's
product form). Each extra draft token of row b at position i adds ``g = prod_{j<=i} alpha[b][j]``, which falls
with i, so for any total S of draft tokens the best split takes the S largest gains of all rows.

A tree's budget b keeps the tree's first b nodes (Top1Proposer's cut, ancestor-closed), and node j (in that
order) is on the accepted path or not whatever the nodes after it are: a node's fate depends on its ancestors
only, all of which come before it. So E_b(budget) = 1 + sum_{j<budget} q[b][j], where ``q[b][j]`` estimates
P(node j on the accepted path): shrunk counts (hits + ``strength`` x g[j]) / (seen + ``strength``), the counts
decaying by ``forget`` per observation, g[j] the batch-wide rate of all requests so far (started at
``prior ** (j + 1)``). Every node of the whole tree the proposer drafted is observed, not only the scored ones
(``StepResult.node_outcomes``, :func:`node_outcomes`): a greedy row emits the target's argmax whatever was
scored, so a node left out by the cut was accepted iff its root-to-node tokens equal the emitted ones; a
sampled row learns from its scored nodes. Without that, a short budget would stop seeing the nodes it skips
(in a replay of Spec-Bench paths, per-request EMAs that saw only scored nodes chose 3 of 6 nodes in roleplay and
lost 6% to the static tree). Node gains need not fall with j (a grafted branch's nodes come last), so each row's
are replaced by their decreasing (concave) envelope, pooled over runs that rise, before the split above; the
envelope's sums equal the true ones at every budget the split ends on but within a pooled run. A row at 0 for
``probe_every`` steps scores its whole tree once. Without outcomes a tree is read as a chain of best-first
nodes, its alphas measured on its accepted depth. The step costs T(S) = forward(B + S rows, B) + draft(S) +
overhead seconds (cost_model.CostModel: measured at start-up or read from ``cost_table``, refreshed from live
steps unless ``refresh_cost`` is False; T(0) is the plain worker's measured step when ``BatchView.plain``), and
the policy takes

    S* = argmax_{S >= 0} (B + sum of the S largest gains) / T(S)

(S = 0: no speculation this step), unless drafting every candidate (the S of all rows' gains: the static choice
as far as the estimates reach) is predicted within ``margin`` (3%) of it: then that. The model's errors are larger
than the differences it ranks near the optimum: the start-up table's shape is one draw of a host whose per-row
cost moves with its memory phase (on the 2-core Zen 4 box, 4 -> 6 nodes read +0 in one calibration and +0.5 ms in
another), and eagle3_ngram's goodput chose 4.4 of 6 nodes on average in one Spec-Bench run and 6.0 in the next,
losing 5-7% to the static tree in four categories in the first. The margin keeps the configured tree where the
model sees no clear gain, and leaves the choices where it does (a batch of 16 rows, k = 10 n-gram drafts: many
times the margin). A request that has not drafted for ``probe_every`` steps gets one draft
token (a tree: its whole tree), so its estimate can recover, unless the batch is shadowed (below). Probes are
priced: longest idle first, a step probes only what the probe credit pays for, the credit growing by
``probe_share`` of each step's predicted seconds (capped at 4 plain steps) and spent on the probes' extra seconds
over the step as chosen (from a plain step: the switch to a speculative one; the table's figure times
``probe_scale``, an EMA of measured / predicted over probe-only steps), less their expected tokens at the plain
path's price. Unpriced, they made every ~9th step of eagle3_ngram at B = 12 score a tree for most of the
batch (rows that start together come due together), several plain steps' worth each. A row is not probed where
even its whole limit, drafted and accepted, would not raise the step's rate: nothing it could learn changes a
choice at that batch (at B = 11-12, credit saved at batch 1 paid for 4-6 tree probes in one 233-377 ms step).
Pure Python over B x k floats, no torch op: choose + observe measured 0.27-0.29 ms at B = 16, k = 10 on a shared
2-core box (test_policy.py prints it), far less at small B.

Shadow acceptance, instead of probes, for proposers whose drafts are nearly free and a function of the tokens
alone (``Proposer.free_drafts``: n-gram and suffix; chains only). When such a row drafts nothing (k = 0 chosen), the worker
still asks the proposer what it would have drafted (its limit's worth, before the step), keeps it in a
:class:`ShadowDrafts`, and compares it with the tokens the row actually emits over the following steps: draft
position i counts as accepted iff it and every position before it equal the emitted tokens, the first mismatch
as the rejection, exactly what verifying that draft would have decided. Greedy rows: exact (the emitted tokens
are the target's argmax whether or not the row drafted). Sampled rows: the same law, not the same draws (a
one-hot draft d is accepted with probability p(d); the emitted token equals d with probability p(d), the
output's law not depending on drafting). The result reaches the policy through :meth:`SpeculationPolicy.
observe_shadow` as if observed; ``BatchView.shadow`` tells the policy the worker does this, and the goodput
policy then issues no probes. Only estimates see shadow data: what is proposed, verified and emitted is not
touched. At most ``shadow_rows`` rows start a shadow per step (the goodput policy's option, 4 by default; those
asked longest ago first): a shadow costs a lookup over the row's tokens (20-30 us for n-gram at 500-700 tokens), and
asking every row of a saturated batch cost 0.45 ms a step at B = 16, 2.5% of its plain step, on every step that
speculation was not worth taking; at 4 each row's estimate still moves every B / 4 steps.
Tail shadows (the goodput policy's ``tail_every``, 4): on every 4th step that has one, a row that drafts k > 0 below
its limit is shadowed the same way with its limit's whole draft, and when the step accepts all k of its own drafts the
positions past k resolve against the tokens emitted from there on (``observe_shadow(..., start=k)``). Without them a
chain's acceptance past the k it chose was never observed again, so a low estimate there could not recover (n-gram's
translation, where static's k = 10 wins on long matches: goodput / static 0.92 -> 0.96 in one Spec-Bench run each).
Every step, they cost 0.12 ms a step at batch 1 (the whole draft asked again: 0.042 -> 0.165 ms of policy work, ~2%
of a one-token forward); every 4th, a quarter of it. The rows at 0 come first within ``shadow_rows``.
Draft classes (``takes_classes``; a free-draft chain proposer's ``Proposer.draft_classes``, asked before the choice):
the proposer's confidence in this step's draft per row, n-gram's match length. The worker sets a row of class 0 (no
match: it would draft nothing) to limit 0, and the goodput policy keeps the alphas above per (request, class), each
started from a batch-wide EMA of its class; outcomes, shadows included, teach the class the draft had when it was
made. Why: on SmolLM2's greedy Spec-Bench outputs a 3-gram match's draft (k = 10) accepted 4.7 tokens on average, a
2-gram's 1.7, a 1-gram's 0.6, and 25% of positions had no match; one estimate per request mixed them, so a row drafted
the same k after a weak match as after a strong one. ``ab`` against the per-request estimate, n-gram goodput on 33
prompts of 11 categories: 1.019x (median 1.036), tau 1.530 -> 1.545; summarization and rag 1.004x (10 prompts).
Large batches (``large_batch`` rows or more, 8 by default). An all-zero choice is held: the next ``consult_every``
- 1 steps of the same rows (4 by default) take 0 without a choice and start no shadow draft
(:meth:`SpeculationPolicy.reuses_zeros`, asked by the worker first), unless a shadow resolves with two accepted
tokens or more (the next step chooses afresh; at one, 40 of 127 holds at B = 16 broke). At B = 16 the choice and the
shadows cost 0.46 ms a step, 5% of a one-token forward; held, ~0.2 ms. And with ``off_while_queued`` (default), such a batch drafts nothing while requests wait in the queue
(``BatchView.num_waiting``). The server is then throughput-bound, where a step's extra tokens pay least on a
CPU, and a request that finishes early admits the next one early: its prefill, an exclusive step of 0.3-0.6 s, stalls
every running request mid-life. Requests that start and finish in lockstep (plain decoding of a burst) take their
successors' prefills together, before those emit (time to first token). Measured (64 Spec-Bench prompts at once, 16
at a time, 1 thread, n-gram, one process): the decode time inside a request's life per token was the same as plain's
(31-32 ms), but the prefill time inside it was 15-20 ms per token against plain's 5.6, as goodput's staggered
finishes made 29-36 prefill steps of 25; its median TPOT 47-52 ms against 37-38. Off while queued: 38.0-38.3 ms,
5.6 ms of prefill per token, 25 prefill steps. The per-step model cannot see this cost, so the rule stands beside it.

Knows nothing about proposers, engines or verification.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from specdec.core.arg_types import check_arg_types
from specdec.spec_decode.cost_model import CostModel, non_decreasing


@dataclass
class BatchView:
    """What a policy sees of one speculative step, rows in batch order."""

    seq_ids: list[int]  # [B]
    limits: list[int]  # [B] the most each row may draft (0 = it cannot this step)
    tree: bool = False  # True: the numbers are node budgets of a tree of ``depth``
    depth: int = 0  # a chain: the configured k; a tree: its longest path (Top1Proposer.max_path)
    num_waiting: int = 0  # requests waiting behind the batch
    # True: a row that drafts nothing is observed through shadow drafts (module docstring; observe_shadow),
    # so its estimate stays fresh without probes
    shadow: bool = False
    plain: bool = False  # True: a step where every row drafts 0 runs the plain worker (CostModel prices it apart)
    # [B] tokens in each row's sequence (a drafted row's attention reads them: CostModel.ctx_slope); [] = not known
    contexts: list[int] = field(default_factory=list)
    # [B] the proposer's confidence class per row (Proposer.draft_classes: n-gram's match length; a row of class 0
    # has limit 0), for a policy that ``takes_classes``; None = no classes
    classes: list[int] | None = None


@dataclass
class StepResult:
    """What one speculative step did, rows in batch order (SpecDecodeWorker fills it)."""

    seq_ids: list[int]  # [B]
    chosen: list[int]  # [B] the policy's numbers
    proposed: list[int]  # [B] nodes the proposer actually drafted (<= chosen)
    accepted: list[int]  # [B] accepted drafts (a tree: the accepted path's length)
    times: dict[str, float] = field(default_factory=dict)  # propose / score / verify seconds
    # a tree: per row, per node of the whole drafted tree (before the policy's cut), 1 = on the accepted path,
    # 0 = not, -1 = unknown (node_outcomes); None where the caller does not record them
    node_outcomes: list[list[int]] | None = None
    classes: list[int] | None = None  # [B] the rows' BatchView.classes of this step (None: none)


def node_outcomes(tokens: list[int], parents: list[int],  # [n] a row's whole drafted tree, before any cut
                  scored: int, path: list[int],  # its first ``scored`` nodes were verified; ``path`` accepted
                  emitted: list[int] | None,  # a greedy row's emitted tokens (accepted drafts, then the last)
                  ) -> list[int]:
    """[n] per node: 1 on the accepted path, 0 not, -1 unknown. Scored nodes: from ``path``. With ``emitted``
    (greedy rows only: the target's argmax chain, which does not depend on what was scored) the others too: a
    node is on the path iff its root-to-node tokens equal the emitted ones; one deeper than ``emitted`` along
    them, or under an unknown node, is unknown. Pure Python over a step's few nodes."""
    on, out, depth = set(path), [], []
    for j, (t, p) in enumerate(zip(tokens, parents)):
        d = 1 if p < 0 else depth[p] + 1
        depth.append(d)
        if j < scored:
            out.append(1 if j in on else 0)
        elif emitted is None or (p >= 0 and out[p] == -1):
            out.append(-1)
        elif p >= 0 and out[p] == 0:
            out.append(0)
        else:
            out.append(-1 if d > len(emitted) else int(t == emitted[d - 1]))
    return out


class SpeculationPolicy(ABC):
    """Chooses per request how much to draft each step (module docstring)."""

    needs_cost: bool = False  # True: the worker measures the engine's cost table before the first choice
    cost_table: str | None = None  # a JSON file: the cost table is read from it if it exists, else written there
    refresh_cost: bool = True  # False: the cost table stays as measured / read (replayable choices)
    takes_shadow: bool = False  # True: observe_shadow uses shadow drafts (the worker then asks for them)
    shadow_rows: int | None = None  # the most rows that start a shadow draft in one step (None: every one due)
    takes_node_outcomes: bool = False  # True: observe reads a tree's StepResult.node_outcomes (else not computed)
    # n > 0 (with takes_shadow): on every n-th step that has one, rows that draft k below their limit also get a
    # shadow of their whole limit, and the positions past k reach observe_shadow with start = k (module docstring:
    # tail shadows); 0 = none
    tail_every: int = 0
    takes_classes: bool = False  # True: the worker gives BatchView / StepResult / observe_shadow the draft classes

    @abstractmethod
    def choose(self, batch: BatchView, cost: CostModel) -> list[int]:
        """[B] draft tokens (a tree: nodes) per row, each in [0, batch.limits[b]]."""

    def reuses_zeros(self, seq_ids: list[int]) -> bool:
        """Asked before ``choose`` each step: True = this step of ``seq_ids`` takes 0 for every row without a
        choice (and the worker starts no shadow draft). Default: never; the goodput policy holds an all-zero choice
        of a large batch for a few steps (its ``consult_every``)."""
        return False

    def observe(self, result: StepResult) -> None:
        """The step's outcome: update online state. Default: none."""

    def observe_shadow(self, seq_id: int, proposed: int, accepted: int, start: int = 0, cls: int | None = None) -> None:
        """A shadow draft of ``proposed`` tokens resolved (module docstring): its first ``accepted`` matched the
        emitted tokens (``accepted < proposed``: the next one did not). ``start`` > 0 (a tail shadow, only where
        ``tail_every``): the row drafted and had accepted its first ``start`` (<= ``accepted``), so only the
        positions past them are news. ``cls``: the row's draft class when the shadow started (only where
        ``takes_classes``). Default: ignored."""

    def free(self, seq_id: int) -> None:
        """The sequence finished: drop its state."""


class ShadowDrafts:
    """The pending shadow drafts of rows that drafted nothing (module docstring), one per sequence at a time."""

    def __init__(self) -> None:
        # seq id -> (its draft, tokens emitted since, positions the row drafted itself this step: 0, or a tail's k,
        # the row's draft class then or None)
        self.pending: dict[int, tuple[list[int], list[int], int, int | None]] = {}
        self.asked: dict[int, int] = {}  # seq id -> the pick (below) that last asked it for a shadow draft
        self.picks = 0

    def pick(self, seq_ids: list[int], most: int | None) -> list[int]:
        """Indices into ``seq_ids`` (rows that could start a shadow) of at most ``most`` of them (None: all), those
        asked longest ago first (never asked: first of all); they are recorded as asked now, drafted or not."""
        self.picks += 1
        rows = list(range(len(seq_ids)))
        if most is not None and len(rows) > most:
            asked = self.asked
            rows = sorted(sorted(rows, key=lambda r: asked.get(seq_ids[r], -1))[:most])
        for r in rows:
            self.asked[seq_ids[r]] = self.picks
        return rows

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def start(self, seq_id: int, draft: list[int], skip: int = 0, cls: int | None = None) -> None:
        """``draft``: what the proposer would draft after the sequence's pending token, before this step; ``skip``:
        the row drafts its first ``skip`` itself this step (a tail shadow: only a longer draft is news); ``cls``: its
        draft class (BatchView.classes), handed back when it resolves."""
        if len(draft) > skip and seq_id not in self.pending:
            self.pending[seq_id] = (list(draft), [], skip, cls)

    def emitted(self, seq_id: int, tokens: list[int]) -> tuple[int, int, int, int | None] | None:
        """The sequence emitted ``tokens``: (proposed, accepted, skip, class) once its draft's fate is known, else
        None; a tail shadow whose row did not accept its own ``skip`` drafts ends with None (its positions past them
        were never reached: nothing to learn)."""
        draft, seen, skip, cls = self.pending[seq_id]
        seen.extend(tokens)
        n = len(draft)
        m = min(n, len(seen))
        a = 0
        while a < m and draft[a] == seen[a]:
            a += 1
        if a < m or m == n:  # a mismatch, or every draft token matched
            del self.pending[seq_id]
            return (n, a, skip, cls) if a >= skip else None
        return None

    def drop(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)

    def free(self, seq_id: int) -> None:
        """The sequence finished."""
        self.pending.pop(seq_id, None)
        self.asked.pop(seq_id, None)

    def clear(self) -> None:
        self.pending.clear()


def report_shadow(policy: SpeculationPolicy, seq_id: int, seen: tuple[int, int, int, int | None] | None) -> None:
    """A resolved shadow (ShadowDrafts.emitted: (proposed, accepted, skip, class), or None) to ``policy``; a tail's
    ``skip`` goes as ``start`` and a class as ``cls``, a row at 0's without them (policies written for the
    three-argument form keep working: a class is given only to a policy that ``takes_classes``)."""
    if seen is None:
        return
    n, a, skip, cls = seen
    if cls is not None:
        policy.observe_shadow(seq_id, n, a, start=skip, cls=cls)
    elif skip:
        policy.observe_shadow(seq_id, n, a, start=skip)
    else:
        policy.observe_shadow(seq_id, n, a)


class StaticPolicy(SpeculationPolicy):
    """The configured k (tree budget) whenever the row may draft: the behaviour before policies."""

    def choose(self, batch: BatchView, cost: CostModel) -> list[int]:
        return list(batch.limits)


class BatchSizePolicy(SpeculationPolicy):
    """k by batch size (vLLM's num_speculative_tokens_per_batch_size). ``schedule``: [[max batch, k], ...];
    the first entry whose max batch >= B gives k (capped by each row's limit); above the last: 0."""

    def __init__(self, schedule: list[list[int]] | None = None) -> None:
        # default: full k alone or in pairs, 2 drafts up to 8, 1 up to 16, none beyond (this CPU's forward is
        # compute-bound past ~16 rows: DESIGN.md's v(17) ~ 1.5-3.2)
        self.schedule = [tuple(e) for e in (schedule or [[2, 64], [8, 2], [16, 1]])]
        if any(len(e) != 2 or e[0] < 1 or e[1] < 0 for e in self.schedule) or \
                [e[0] for e in self.schedule] != sorted(e[0] for e in self.schedule):
            raise ValueError(f"batch_size policy: schedule={schedule} must be [[max batch >= 1, k >= 0], ...] with "
                             "ascending max batch, e.g. [[2, 8], [8, 2], [16, 1]]")

    def choose(self, batch: BatchView, cost: CostModel) -> list[int]:
        B = len(batch.limits)
        k = next((kk for mb, kk in self.schedule if B <= mb), 0)
        return [min(k, lim) for lim in batch.limits]


class AcceptanceEMAPolicy(SpeculationPolicy):
    """SGLang-style tiers: per request, an EMA of accepted drafts per step; draft the smallest tier above it."""

    def __init__(self, tiers: list[int] | None = None, ema: float = 0.3) -> None:
        self.tiers = sorted(tiers or [1, 3, 7])
        if not self.tiers or self.tiers[0] < 1 or not 0 < ema <= 1:
            raise ValueError(f"acceptance_ema policy: tiers={tiers} must be ints >= 1 and ema={ema} in (0, 1]")
        self.ema = ema
        self.start = float(self.tiers[len(self.tiers) // 2] - 1)  # a new request starts at the middle tier
        self.accepted: dict[int, float] = {}  # seq id -> EMA of accepted drafts per speculative step

    def choose(self, batch: BatchView, cost: CostModel) -> list[int]:
        out = []
        for s, lim in zip(batch.seq_ids, batch.limits):
            acc = self.accepted.get(s, self.start)
            out.append(min(next((t for t in self.tiers if t >= acc + 1), self.tiers[-1]), lim))
        return out

    takes_shadow = True

    def observe(self, result: StepResult) -> None:
        for s, n, a in zip(result.seq_ids, result.proposed, result.accepted):
            if n:
                self._learn(s, a)

    def observe_shadow(self, seq_id: int, proposed: int, accepted: int, start: int = 0, cls: int | None = None) -> None:
        self._learn(seq_id, accepted)

    def _learn(self, seq_id: int, accepted: int) -> None:
        old = self.accepted.get(seq_id, self.start)
        self.accepted[seq_id] = old + self.ema * (accepted - old)

    def free(self, seq_id: int) -> None:
        self.accepted.pop(seq_id, None)


class GoodputPolicy(SpeculationPolicy):
    """Maximises expected emitted tokens per second of the whole step (module docstring)."""

    needs_cost = True
    takes_shadow = True
    takes_node_outcomes = True
    takes_classes = True

    def __init__(self, prior: float = 0.5, ema: float = 0.3, probe_every: int = 8, min_gain: float = 1e-3,
                 cost_table: str | None = None, refresh_cost: bool = True, strength: float = 16.0,
                 forget: float = 0.97, probe_share: float = 0.01, shadow_rows: int | None = 4,
                 consult_every: int = 4, large_batch: int = 8, off_while_queued: bool = True,
                 margin: float = 0.03, tail_every: int = 4) -> None:
        self.cost_table, self.refresh_cost = cost_table, refresh_cost
        if (not 0 <= prior <= 1 or not 0 < ema <= 1 or probe_every < 0 or strength < 0 or not 0 < forget <= 1
                or not probe_share >= 0 or not (shadow_rows is None or (type(shadow_rows) is int and shadow_rows >= 1))
                or type(consult_every) is not int or consult_every < 1
                or type(large_batch) is not int or large_batch < 1):
            raise ValueError(f"goodput policy: prior={prior} must be in [0, 1], ema={ema} in (0, 1], probe_every="
                             f"{probe_every} >= 0 (0 = never probe a request the policy switched off), strength="
                             f"{strength} >= 0, forget={forget} in (0, 1], probe_share={probe_share} >= 0 (the "
                             f"share of step time that probes may cost), shadow_rows={shadow_rows!r} an int >= 1 or "
                             "null (the most rows that start a shadow draft per step; null = every row), "
                             f"consult_every={consult_every!r} an int >= 1 (1 = choose every step) and large_batch="
                             f"{large_batch!r} an int >= 1 (the smallest batch whose all-zero choice is held)")
        if not (type(margin) in (int, float) and 0 <= margin < 1):
            raise ValueError(f"goodput policy: margin={margin!r} must be a number in [0, 1): the predicted gain in "
                             "tokens per second below which the step drafts every candidate (0 = always the argmax)")
        self.margin = float(margin)
        if type(tail_every) is not int or tail_every < 0:
            raise ValueError(f"goodput policy: tail_every={tail_every!r} must be an int >= 0 (a tail shadow on every "
                             "n-th step that has a row below its limit; 0 = none)")
        self.tail_every = tail_every
        if type(off_while_queued) is not bool:
            raise ValueError(f"goodput policy: off_while_queued={off_while_queued!r} must be true or false (true: a "
                             "batch of >= large_batch rows drafts nothing while requests wait)")
        self.shadow_rows = shadow_rows
        # an all-zero choice of >= large_batch rows is reused for up to consult_every - 1 more steps of the same rows;
        # off_while_queued: such a batch drafts nothing while requests wait (module docstring)
        self.consult_every, self.large_batch, self.off_while_queued = consult_every, large_batch, off_while_queued
        self._hold, self._held_ids = 0, ()  # steps left to reuse it; the rows it was chosen for
        self.consults = 0  # choices made (choose calls); the steps held are the rest
        self.probe_share, self.credit = probe_share, 0.0  # probe credit, seconds (module docstring)
        # a probe step's measured extra seconds over the plain step / the table's prediction, an EMA from probe-only
        # steps (the table misses what a long idle row's catch-up costs); the step awaiting its measurement
        self.probe_scale, self._probe_step = 1.0, None
        self.prior, self.ema, self.probe_every, self.min_gain = prior, ema, probe_every, min_gain
        self.strength, self.forget = strength, forget
        self.global_alpha: list[float] = []  # batch-wide EMA per position: a new request's start
        self.alpha: dict[int, list[float]] = {}  # seq id -> conditional acceptance per draft position
        # the same per draft class (BatchView.classes: n-gram's match length), where the proposer gives classes
        self.class_alpha: dict[int, list[float]] = {}  # class -> batch-wide EMA per position
        self.alpha_by_class: dict[int, dict[int, list[float]]] = {}  # seq id -> class -> its EMA per position
        self.idle: dict[int, int] = {}  # seq id -> steps since it last drafted
        self.depth = 0
        # trees with node outcomes (module docstring): per node j, batch-wide [hits, seen] and per request decayed
        self.global_hits: list[list[float]] = []
        self.node_hits: dict[int, list[list[float]]] = {}
        self._learnt, self._envelopes = 0, {}  # node outcomes seen; seq id -> (_learnt, n, envelope) (_envelope)

    def alphas(self, seq_id: int, n: int, cls: int | None = None) -> list[float]:
        """Request ``seq_id``'s conditional acceptance at positions 1..n (grown from the batch-wide estimate); with a
        draft class ``cls``, its estimate for drafts of that class (grown from the batch-wide one of the class)."""
        if cls is None:
            a, g = self.alpha.setdefault(seq_id, []), self.global_alpha
        else:
            a = self.alpha_by_class.setdefault(seq_id, {}).setdefault(cls, [])
            g = self.class_alpha.setdefault(cls, [])
        while len(g) < n:
            g.append(self.prior)
        while len(a) < n:
            a.append(g[len(a)])
        return a

    def node_qs(self, seq_id: int, n: int) -> list[float]:
        """Request ``seq_id``'s estimated P(node j on the accepted path), j < n (module docstring)."""
        g, own, k = self.global_hits, self.node_hits.get(seq_id, []), self.strength
        out = []
        for j in range(n):
            gh, gn = g[j] if j < len(g) else (0.0, 0.0)
            base = (gh + 4 * self.prior ** (j + 1)) / (gn + 4)  # the prior counts as 4 observations
            h, m = own[j] if j < len(own) else (0.0, 0.0)
            out.append((h + k * base) / (m + k) if m + k > 0 else base)
        return out

    def reuses_zeros(self, seq_ids: list[int]) -> bool:
        if self._hold and tuple(seq_ids) == self._held_ids:
            self._hold -= 1
            return True
        self._hold = 0
        return False

    def choose(self, batch: BatchView, cost: CostModel) -> list[int]:
        B = len(batch.limits)
        queued = self.off_while_queued and batch.num_waiting > 0 and B >= self.large_batch
        out = [0] * B if queued else self._choose(batch, cost)
        self.consults += 1
        held = self.consult_every > 1 and len(out) >= self.large_batch and not any(out)
        self._hold, self._held_ids = (self.consult_every - 1, tuple(batch.seq_ids)) if held else (0, ())
        return out

    def _choose(self, batch: BatchView, cost: CostModel) -> list[int]:
        limits = batch.limits
        B = len(limits)
        if not cost.calibrated:  # nothing measured yet: the static choice (its steps calibrate the table)
            return list(limits)
        self.depth = batch.depth
        gains: list[tuple[float, int]] = []  # (expected extra emitted tokens, row) of every candidate draft token
        nodes = batch.tree and bool(self.global_hits)  # per-node estimates exist once a step recorded outcomes
        classes = batch.classes
        for b, (s, lim) in enumerate(zip(batch.seq_ids, limits)):
            if not lim:
                continue
            if nodes:
                gains += [(g, b) for g in self._envelope(s, lim)]
                continue
            n = min(lim, batch.depth) if batch.depth else lim
            al = self.alphas(s, n, None if classes is None else classes[b])
            p, floor = 1.0, self.min_gain
            for i in range(lim):
                p *= al[i] if i < n else al[n - 1]  # a tree past its depth: more nodes at the deepest rate
                if p < floor:
                    break
                gains.append((p, b))
        gains.sort(reverse=True)
        tree = batch.tree
        curve = cost.step_curve(B, len(gains), per_draft_token=not tree, plain=batch.plain)  # [S + 1] seconds
        per_row = cost.per_row if tree else 0.0
        ctx = _priced_contexts(batch, cost)  # [B]
        best_s, best_rate, emitted, drafting = 0, (B / curve[0] if curve[0] > 0 else 0.0), float(B), set()
        row_ctx = 0  # sum of the drafted tokens' contexts so far
        rate = best_rate
        for S, (g, b) in enumerate(gains, 1):
            emitted += g
            row_ctx += ctx[b]
            if per_row:
                drafting.add(b)
            t = curve[S] + per_row * len(drafting) + cost.context_seconds(row_ctx)
            rate = emitted / t if t > 0 else 0.0
            if rate > best_rate:
                best_s, best_rate = S, rate
        if gains and best_s < len(gains) and rate * (1 + self.margin) >= best_rate:
            best_s = len(gains)  # within the margin of the argmax: every candidate, as static would (docstring)
        out = [0] * B
        for _, b in gains[:best_s]:
            out[b] += 1
        step_s = (curve[best_s] + per_row * sum(1 for k in out if k)  # what this choice predicts
                  + cost.context_seconds(sum(k * c for k, c in zip(out, ctx))))
        self.credit = min(self.credit + self.probe_share * step_s, 4 * curve[0])
        if self.probe_every and not batch.shadow:  # shadowed rows learn without drafting
            self._probe(batch, out, nodes, curve[0], cost, B + sum(g for g, _ in gains[:best_s]))
        return out

    def _probe(self, batch: BatchView, out: list[int], nodes: bool, plain_s: float, cost: CostModel,
               emitted: float) -> None:
        """Rows at 0 for ``probe_every`` steps draft once more (a tree: its whole tree, every node seen), longest idle
        first, as many as the probe credit pays for (module docstring), in ``out`` [B]. What a probe adds is priced
        against the step as chosen (``emitted`` expected tokens): on a plain step the switch to a speculative one,
        on a speculative step its nodes and its draft (an EAGLE row idle for long catches up over every token
        since). A row that would not raise the step's rate even with all of its limit drafted and accepted is not
        probed: what it could learn cannot change a choice at this batch (eagle3_ngram at B = 12: a 6-node probe
        costs about a plain step, 12 tokens' worth, and can return 6 at best)."""
        limits, B = batch.limits, len(batch.limits)
        due = sorted((b for b, s in enumerate(batch.seq_ids)
                      if out[b] == 0 and limits[b] and self.idle.get(s, 0) >= self.probe_every),
                     key=lambda b: -self.idle.get(batch.seq_ids[b], 0))
        if not due:
            return
        size = [limits[b] if nodes else 1 for b in due]
        S0, n0 = sum(out), sum(1 for k in out if k)
        curve = cost.step_curve(B, S0 + max(sum(size), max(limits[b] for b in due)), per_draft_token=not batch.tree,
                                plain=batch.plain)  # [S + 1]
        per_row = cost.per_row if batch.tree else 0.0
        per_token = plain_s / B if B else 0.0  # what an emitted token costs on the plain path
        ctx = _priced_contexts(batch, cost)  # [B]
        c_out = cost.context_seconds(sum(k * c for k, c in zip(out, ctx)))  # the chosen drafts' contexts
        chosen = curve[S0] + per_row * n0 + c_out
        S, gain, n, spent, raw, c_probes = S0, 0.0, n0, 0.0, 0.0, 0.0
        for b, k in zip(due, size):
            L = limits[b]  # its best case: all of its limit drafted and accepted, priced as probes are
            with_row = chosen + self.probe_scale * (curve[S0 + L] + per_row * (n0 + 1) + c_out
                                                    + cost.context_seconds(L * ctx[b]) - chosen)
            if chosen > 0 and (emitted + L) * chosen <= emitted * with_row:
                continue  # would not pay at this batch even then
            s = batch.seq_ids[b]
            g = sum(self.node_qs(s, k)) if nodes else self.alphas(s, 1, None if batch.classes is None
                                                                 else batch.classes[b])[0]
            c_b = cost.context_seconds(k * ctx[b])
            r = curve[S + k] + per_row * (n + 1) + c_out + c_probes + c_b - chosen  # the table's extra seconds
            extra = self.probe_scale * r - (gain + g) * per_token
            if extra > self.credit:
                break
            S, gain, n, spent, raw, c_probes = S + k, gain + g, n + 1, max(extra, 0.0), r, c_probes + c_b
            out[b] = k
        self.credit -= spent
        if S0 == 0 and n and raw > 0:  # a probe-only step: its measured time corrects the table's price
            self._probe_step = (raw, plain_s)

    def observe(self, result: StepResult) -> None:
        if self._probe_step is not None:  # the step chosen last was probes only
            raw, plain_s = self._probe_step
            self._probe_step = None
            step_s = sum(result.times.get(k, 0.0) for k in ("propose", "score", "verify"))
            if step_s > 0 and any(result.proposed):
                ratio = min(max((step_s - plain_s) / raw, 0.5), 5.0)
                self.probe_scale += self.ema * (ratio - self.probe_scale)
        outcomes = result.node_outcomes  # a tree's nodes: per-node estimates (module docstring)
        classes = result.classes
        for r, (s, c, n, a) in enumerate(zip(result.seq_ids, result.chosen, result.proposed, result.accepted)):
            if not n:
                self.idle[s] = self.idle.get(s, 0) + 1 if c == 0 else 0
                continue
            self.idle[s] = 0
            if outcomes is not None:  # the chain's alphas are not read for a tree that has outcomes
                self._learn_nodes(s, outcomes[r])
            else:
                self._learn(s, n, a, 0, None if classes is None else classes[r])

    def _envelope(self, seq_id: int, n: int) -> list[float]:
        """The decreasing envelope of ``seq_id``'s first ``n`` node estimates, those >= ``min_gain``; kept until a
        node outcome arrives (a batch's idle rows would otherwise recompute theirs every step)."""
        hit = self._envelopes.get(seq_id)
        if hit is not None and hit[0] == self._learnt and hit[1] == n:
            return hit[2]
        env = [g for g in decreasing_envelope(self.node_qs(seq_id, n)) if g >= self.min_gain]
        self._envelopes[seq_id] = (self._learnt, n, env)
        return env

    def _learn_nodes(self, seq_id: int, outcomes: list[int]) -> None:
        """A tree step's outcome per drafted node (1 / 0 / -1 unknown: not counted)."""
        self._learnt += 1  # every row's estimate moves with the batch-wide counts
        g, own, f = self.global_hits, self.node_hits.setdefault(seq_id, []), self.forget
        for j, x in enumerate(outcomes):
            while len(g) <= j:
                g.append([0.0, 0.0])
            while len(own) <= j:
                own.append([0.0, 0.0])
            if x < 0:
                continue
            g[j][0] += x
            g[j][1] += 1
            own[j][0] = f * own[j][0] + x
            own[j][1] = f * own[j][1] + 1

    def observe_shadow(self, seq_id: int, proposed: int, accepted: int, start: int = 0, cls: int | None = None) -> None:
        self._learn(seq_id, proposed, accepted, start, cls)
        if accepted >= 2 and not start:  # a row at 0 would have gained two tokens or more: choose afresh
            self._hold = 0

    def _learn(self, seq_id: int, n: int, a: int, start: int = 0, cls: int | None = None) -> None:
        """One outcome of ``n`` drafts, ``a`` accepted: positions 1..a accepted, a+1 rejected when proposed; only
        positions past ``start`` (a tail shadow's: the step itself observed the first ``start``); ``cls``: the
        draft's class (its estimates and the batch-wide ones of that class learn)."""
        w = self.ema
        seen = min(n, self.depth) if self.depth else n  # positions the proposal reached
        al = self.alphas(seq_id, max(seen, a + 1), cls)
        g = self.global_alpha if cls is None else self.class_alpha[cls]
        for i in range(start, min(a + 1, seen)):  # positions 1..a accepted; a+1 rejected when it was proposed
            x = 1.0 if i < a else 0.0
            al[i] += w * (x - al[i])
            g[i] += w * (x - g[i])

    def free(self, seq_id: int) -> None:
        self.alpha.pop(seq_id, None)
        self.alpha_by_class.pop(seq_id, None)
        self.idle.pop(seq_id, None)
        self.node_hits.pop(seq_id, None)
        self._envelopes.pop(seq_id, None)


def _priced_contexts(batch: BatchView, cost: CostModel) -> list[int]:
    """[B] each row's context where the cost table prices it (CostModel.ctx_slope), else zeros."""
    B = len(batch.limits)
    return batch.contexts if cost.ctx_slope and len(batch.contexts) == B else [0] * B


def decreasing_envelope(gains: list[float]) -> list[float]:
    """The least non-increasing sequence whose prefix sums are >= ``gains``' and equal at each pooled run's end
    (pool adjacent violators: a run that rises is replaced by its mean). [n] -> [n]."""
    return [-g for g in non_decreasing([-g for g in gains])]


POLICIES: dict[str, type[SpeculationPolicy]] = {
    "static": StaticPolicy, "batch_size": BatchSizePolicy, "acceptance_ema": AcceptanceEMAPolicy,
    "goodput": GoodputPolicy,
}


def make_policy(name: str, options: dict | None = None) -> SpeculationPolicy:
    """The policy ``name`` (a key of POLICIES or 'pkg.module:Class'), built with ``options`` as keyword
    arguments; an unknown name or option is refused naming the ones it takes."""
    options = dict(options or {})
    if name in POLICIES:
        cls = POLICIES[name]
    else:
        import importlib

        module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr) if module and attr else None
        except (ImportError, AttributeError, ValueError):
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, SpeculationPolicy)):
            raise ValueError(f"speculation_policy={name!r} is unknown: one of {sorted(POLICIES)}, or "
                             "'package.module:Class' of a specdec.spec_decode.policy.SpeculationPolicy subclass")
    params = inspect.signature(cls.__init__).parameters
    takes = sorted(p for p in params if p != "self")
    unknown = sorted(k for k in options if k not in params or k == "self")
    if unknown:
        raise ValueError(f"policy_options {unknown} are not options of speculation_policy={name!r}: it takes "
                         f"{takes or 'none'}")
    check_arg_types(cls, options, "policy_options")
    return cls(**options)
