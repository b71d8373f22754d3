"""`python -m specdec.replay <run dir> [proposer=...] [proposer.num_speculative_tokens=...] [scorer=tree ...]`.

Offline acceptance replay (issue #15): reruns only the drafter against a trace (specdec/experiment/trace.py) and
writes the same acceptance figures as specdec.experiment.run (tau, acceptance per position, alpha, the theory's
predicted tau; no speed) to summary.json, printing its path last. Hydra, the same config groups as
specdec.experiment.run (conf/replay.yaml composes conf/config.yaml), so `-m proposer.num_speculative_tokens=1,2,4,8`
sweeps and `python -m specdec.report` reads the sweep. The model, max_model_len and seed are the trace's.

Greedy traces (temperature 0): the target's output for a prompt is fixed, so a drafter's acceptance at each
step is decided by its drafts against the recorded continuation. Each step is what the worker does
(specdec/spec_decode/spec_decode_worker.py), less the target: Top1Proposer builds the ProposeBatch from the recorded
prefix (and, for a proposer with a FeatureSpec, the recorded feature rows threaded exactly as the worker
threads them); the accepted path is the longest root-to-node path whose tokens equal the recorded tokens
(ties: the lowest node index, as specdec_kernels/tree.py; a chain: its matching prefix); the sequence advances by
accepted + 1 tokens and the proposer is told through ``Proposer.accepted``. A draft compared past the end of
the recording counts as rejected (``replay.steps_past_recording`` says how often; it is 0 whenever the
drafter is the one the trace was recorded with, since the trace keeps the last step's tokens past the stop).

Traces at T > 0 (``replay.mode = expected``): the replay walks the recorded trajectory one token at a time
and takes the drafter's q for the next token (k = 1, one-hot for deterministic drafters) against the
recorded top-N target p: alpha_t = sum_x min(p_t(x), q_t(x)) (Leviathan et al. 2023, section 3.2). The
tail outside the top N bounds it: alpha_t is in [lower, lower + min(1 - sum_topN p, 1 - sum_topN q)]. A
chain of k then accepts position i with probability prod_{j<i} alpha_{t+j} (conditioning each q on the
recorded prefix rather than on the draft's own tokens, the usual approximation); ``acceptance_per_position``
and ``mean_acceptance_length`` are the lower figures, ``replay`` holds both bounds.

A speculation policy (``proposer.speculation_policy``, specdec/spec_decode/policy.py) is replayed too: each step
it chooses the k (tree: budget) of the one replayed sequence and learns from the replayed outcome, as live; goodput
decides from a cost table (``policy_options.cost_table``, else the one the traced run left in meta.json), which a
replay has no live times to refresh. The summary then holds ``chosen_k_histogram`` and ``replay.modelled_tokens_per_s``
(the emitted tokens over the table's seconds for the replayed steps, batch 1, prefill excluded). Requests are
replayed one at a time: a batch's choices (batch_size, goodput's shared forward) are not.

The target engine is loaded only if the proposer touches it (:class:`LazyTarget`): n-gram never does, a draft
model reads its vocab size and context, layer-skip runs the target's first layers, EAGLE its embedding and
LM head (its features come from the trace). Knows nothing about timing: replayed runs have no speed.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from specdec_kernels import get_ops
from specdec.datamodel.metrics import record_acceptance
from specdec.experiment.summary import RequestRecord, RunSummary, write_summary

log = logging.getLogger("specdec.replay")
REPLAY_KEYS = ("run_dir",)  # conf/replay.yaml's keys beyond RunConfig's
# run keys whose values a replay takes from the trace, whatever the command line says (refused there)
FROM_TRACE = ("model", "max_model_len", "seed", "sampling", "dataset", "turns", "max_num_seqs")


class ReplaySummary(RunSummary, kw_only=True):
    # trace, mode (greedy | expected), requests, steps, steps_past_recording, wall_time_s; at T > 0: alpha and
    # tau lower/upper bounds and acceptance_per_position_upper
    replay: dict[str, Any] = msgspec.field(default_factory=dict)


class LazyTarget:
    """Stands in for the target engine: its size facts come from the trace; touching anything else loads it."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.vocab_size = int(meta["vocab_size"])
        self.max_model_len = int(meta["max_model_len"])
        self.num_slots = 1  # the replay runs one request at a time, as the live runs (batch 1)
        self.dtype = trace_dtype(meta)
        self.device = torch.device("cpu")
        self._meta = meta
        self._engine = None

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_engine", "_meta"):
            raise AttributeError(name)
        if self._engine is None:
            from specdec.engine.loader import load_engine

            log.info("the proposer reads target.%s: loading the target %s", name, self._meta["model"])
            self._engine = load_engine(self._meta["model"], num_slots=self.num_slots, max_model_len=self.max_model_len,
                                       dtype=self._meta["dtype"], seed=int(self._meta.get("seed", 0)))
        return getattr(self._engine, name)


@dataclass
class Replayer:
    """One proposer (through Top1Proposer, as the worker holds it) replayed request by request."""

    top1: Any  # Top1Proposer
    features: Any  # the proposer's FeatureSpec | None
    steps: int = 0
    past: int = 0  # steps whose drafts ran past the recorded tokens
    notes: list[str] = field(default_factory=list)
    policy: Any = None  # the SpeculationPolicy choosing each step's k (None: the configured k, static)
    cost: Any = None  # its CostModel (goodput), as read: a replay has no live times to refresh it from
    chosen: dict[int, int] = field(default_factory=dict)  # the policy's k (tree: budget) -> steps
    modelled_s: float = 0.0  # the cost table's seconds for the replayed steps (batch 1, prefill excluded)
    emitted: int = 0  # tokens the replayed steps emitted
    _k: int = 0  # the last step's choice
    _ctx: int = 0  # the last step's context length
    # the live worker's shadow drafts (policy.py): rows at k = 0 under a proposer with free drafts keep the policy's
    # estimate fresh from the tokens they then emit, instead of probes; and a step at 0 runs (and costs) plain
    shadows: Any = None  # ShadowDrafts, made on first use
    _tail_clock: int = 0  # steps with a candidate tail shadow (the worker's clock: SpecDecodeWorker._start_shadows)
    _cls: Any = None  # the step's draft classes (BatchView.classes; the worker's _classes)

    @property
    def proposer(self):
        return self.top1.proposer

    def _rows(self, feats: torch.Tensor | None, a: int, b: int):
        return None if feats is None else feats[a: min(b, feats.shape[0])]  # [<= b-a, F]

    def _step(self, rid: str, seq_id: int, prompt: list[int], tokens: list[int], params, hs, bonus: set[int]):
        from specdec.datamodel.hidden_states import ExecuteModelRequest
        from specdec.datamodel.sequence import SequenceData, SequenceGroupState
        from specdec.datamodel.metadata import SequenceGroupMetadata

        meta = SequenceGroupMetadata(request_id=rid, is_prompt=False,
                                     seq_data={seq_id: SequenceData.from_seqs(prompt, tokens[len(prompt):])},
                                     sampling_params=params, block_tables={seq_id: []},
                                     num_speculative_tokens=self.top1.max_path, state=SequenceGroupState())
        req = ExecuteModelRequest(seq_group_metadata_list=[meta], num_lookahead_slots=self.top1.max_path)
        if hs is not None:
            req.previous_hidden_states = hs.select({seq_id})
        ks = None
        self._ctx = meta.seq_data[seq_id].get_len()  # its context (a drafted row's attention reads it)
        if self.policy is not None:  # the policy's choice for this one sequence, as the worker asks it
            from specdec.spec_decode.policy import BatchView

            limits = self.top1.limits(req)
            shadow = self.policy.takes_shadow and self.top1.free_drafts
            held = params.seed is None and self.policy.reuses_zeros([seq_id])  # the worker's held all-zero choice
            self._cls = None if held or not self.policy.takes_classes else self.top1.draft_classes(req, limits)
            if self._cls is not None:  # the worker's: class 0 drafts nothing
                limits = [lim if c else 0 for lim, c in zip(limits, self._cls)]
            ks = [0] if held else self.policy.choose(
                BatchView([seq_id], limits, tree=self.top1.shape is not None, depth=self.top1.max_path, shadow=shadow,
                          plain=params.seed is None, contexts=[self._ctx], classes=self._cls), self.cost)
            tail = self.policy.tail_every and 0 < ks[0] < limits[0]  # the worker's _start_shadows, its clock too
            if shadow and not held and limits[0] and (not ks[0] or tail) and seq_id not in self._shadows():
                if tail:
                    self._tail_clock += 1
                if not tail or self._tail_clock % self.policy.tail_every == 0:
                    self.shadows.start(seq_id, self.top1.shadow_drafts(req, [0], limits)[0], ks[0],
                                       None if self._cls is None else self._cls[0])
        self._k = ks[0] if ks is not None else self.top1.size
        proposals = self.top1.get_spec_proposals(req, set(bonus), ks)
        if hs is not None:  # the rows the proposer read are spent (the worker's discard)
            hs.discard(set(proposals.drafted_seq_ids))
        return proposals

    def _shadows(self):
        if self.shadows is None:
            from specdec.spec_decode.policy import ShadowDrafts

            self.shadows = ShadowDrafts()
        return self.shadows

    def _resolve_shadow(self, seq_id: int, emitted: list[int]) -> None:
        """The tokens a replayed step emitted against the row's pending shadow draft (the worker's
        _resolve_shadows)."""
        if self.shadows is not None and seq_id in self.shadows:
            from specdec.spec_decode.policy import report_shadow

            report_shadow(self.policy, seq_id, self.shadows.emitted(seq_id, emitted))

    def _prefill(self, seq_id: int, feats: torch.Tensor | None, P: int):
        from specdec.datamodel.hidden_states import HiddenStates

        if self.features is None:
            return None
        rows = self._rows(feats, 0, P)  # [P, F] the prompt's rows, as the prefill threads them
        hs = HiddenStates(rows[:0], None, None, [])
        hs.extend(rows, [seq_id] * rows.shape[0], self.features.history)
        return hs

    def greedy(self, rid: str, seq_id: int, req: dict[str, Any], feats: torch.Tensor | None,
               ) -> tuple[list[int], int]:
        """(acceptance counts [k+1], draft tokens proposed) of one request replayed against its recording."""
        from specdec.interfaces import Verdict
        from specdec.verify.tree import ends_at_leaf

        prompt, full = list(req["prompt_ids"]), list(req["prompt_ids"]) + list(req["target_ids"])
        n_out, P, k = len(req["output_ids"]), len(req["prompt_ids"]), self.top1.max_path
        counts, drafted = [0] * (k + 1), 0
        if n_out == 0:
            return counts, 0
        params = _params(req)
        hs = self._prefill(seq_id, feats, P)
        tokens, emitted, bonus = full[: P + 1], 1, set()
        while emitted < n_out:
            L = len(tokens)
            proposals = self._step(rid, seq_id, prompt, tokens, params, hs, bonus)
            n = int(proposals.num_nodes[0])
            nodes, past = greedy_path(proposals.token_ids[0, :n].tolist(), proposals.parents[0, :n].tolist(), full, L)
            a = len(nodes)
            self.steps += 1
            self.past += past
            drafted += n
            record_acceptance(counts, a)
            self._observe(seq_id, n, a, self._outcomes(proposals, n, nodes, full[L: L + a + 1]))
            path = torch.full((1, n + 1), -1, dtype=torch.long)
            path[0, : a + 1] = torch.tensor([0] + [x + 1 for x in nodes])
            bonus = {seq_id} if bool(ends_at_leaf(proposals, Verdict(path, path.clone()))[0]) else set()
            self.proposer.accepted(seq_id, L, nodes)
            if hs is not None:  # the pending token's row and each accepted draft's (the worker's commit)
                rows = self._rows(feats, L - 1, L + a)
                hs.extend(rows, [seq_id] * rows.shape[0], self.features.history)
            self._resolve_shadow(seq_id, full[L: L + a + 1])
            tokens += full[L: L + a + 1]
            emitted += a + 1
        self.proposer.free(seq_id)
        if self.policy is not None:
            self.policy.free(seq_id)
        if self.shadows is not None:
            self.shadows.drop(seq_id)
        return counts, drafted

    def _outcomes(self, proposals, n: int, nodes: list[int], emitted: list[int]) -> list[int] | None:
        """A tree step's outcome per drafted node, as the worker's _observe gives it (policy.node_outcomes)."""
        from specdec.spec_decode.policy import node_outcomes

        if self.top1.shape is None or self.policy is None or not self.policy.takes_node_outcomes:
            return None
        toks, pars, counts = proposals.uncut or (proposals.token_ids, proposals.parents, proposals.num_nodes)
        c = int(counts[0])
        return node_outcomes(toks[0, :c].tolist(), pars[0, :c].tolist(), n, nodes, emitted)

    def _observe(self, seq_id: int, n: int, a: int, outcomes: list[int] | None) -> None:
        """One replayed step (``outcomes``: a tree's per node): the policy learns its outcome; the cost table
        prices it (batch 1)."""
        from specdec.spec_decode.policy import StepResult

        k = self._k
        self.chosen[k] = self.chosen.get(k, 0) + 1
        self.emitted += a + 1
        if self.policy is not None:
            self.policy.observe(StepResult([seq_id], [k], [n], [a],
                                           node_outcomes=None if outcomes is None else [outcomes], classes=self._cls))
        if self.cost is not None:
            tree = self.top1.shape is not None
            if k == 0 and 1 in self.cost.plain:  # the live worker runs a step at 0 plainly (its own measured time)
                self.modelled_s += self.cost.plain[1]
            else:
                self.modelled_s += (self.cost.step_seconds(1 + n, 1, 0 if tree else n, int(tree and n > 0))
                                    + self.cost.context_seconds(n * self._ctx))

    def expected(self, rid: str, seq_id: int, req: dict[str, Any], feats: torch.Tensor | None,
                 topn: tuple) -> tuple[list[float], list[float]]:
        """T > 0: (alpha lower [T], alpha upper [T]) at every recorded position from the first decode step."""
        positions, ids, probs = topn  # [R], [R, N], [R, N]
        at = {int(p): i for i, p in enumerate(positions)}
        prompt, full = list(req["prompt_ids"]), list(req["prompt_ids"]) + list(req["target_ids"])
        P, n_out = len(prompt), len(req["output_ids"])
        params = _params(req)
        hs = self._prefill(seq_id, feats, P)
        tokens, lo, hi = full[: P + 1], [], []
        while len(tokens) - P < n_out and (len(tokens) - 1) in at:
            L = len(tokens)
            proposals = self._step(rid, seq_id, prompt, tokens, params, hs, set())
            r = at[L - 1]  # the target's p of position L (recorded after position L-1)
            p_ids, p = ids[r], probs[r]  # [N], [N]
            if int(proposals.num_nodes[0]) == 0:  # no draft: rejected (the live counts say the same)
                a_lo = a_hi = 0.0
            else:
                if proposals.draft_probs is not None:
                    q = proposals.draft_probs[0, 0].float()  # [V] the law the draft was drawn from
                else:
                    q = torch.zeros(self.top1.vocab_size)
                    q[int(proposals.token_ids[0, 0])] = 1.0  # deterministic draft: one-hot q
                q_top = q[p_ids]  # [N]
                a_lo = float(torch.minimum(p, q_top).sum())
                a_hi = a_lo + max(0.0, min(1.0 - float(p.sum()), 1.0 - float(q_top.sum())))
            lo.append(a_lo)
            hi.append(min(a_hi, 1.0))
            self.steps += 1
            self.proposer.accepted(seq_id, L, [])  # one token on: the recorded one, whatever was drafted
            if hs is not None:
                rows = self._rows(feats, L - 1, L)
                hs.extend(rows, [seq_id] * rows.shape[0], self.features.history)
            tokens.append(full[L])
        self.proposer.free(seq_id)
        return lo, hi


def greedy_path(tokens: list[int], parents: list[int], full: list[int], L: int) -> tuple[list[int], int]:
    """The accepted nodes (root excluded, in path order) of a proposal hanging off position L-1 of ``full``, by
    the worker's own rule (kernels' tree_greedy_accept: the deepest node whose path matches, ties to the lowest
    index) with the recorded tokens as the target's argmax: after a node at depth d (the root's is 0) the target
    said ``full[L + d]``, for every node whose ancestors all matched (the others are rejected whatever it said).
    Also 1 if a node that could still be accepted was compared past the end of ``full`` (counted as rejected)."""
    ops = get_ops("torch")
    par = torch.tensor([[-1] + [p + 1 for p in parents]])  # [1, n+1] root-inclusive
    tok = torch.tensor([[full[L - 1]] + list(tokens)])  # [1, n+1], node 0 = the pending token
    mask = ops.build_tree_mask(par)[0]  # [n+1, n+1] ancestor-or-self
    depth = mask.sum(-1) - 1  # [n+1]
    said = [full[L + d] if L + d < len(full) else -1 for d in depth.tolist()]  # -1: past the recording
    path, _ = ops.tree_greedy_accept(par, tok, torch.tensor([said]))
    match = tok[0] == torch.tensor(said)[par[0].clamp(min=0)]  # [n+1] each node's token is its parent's said
    match[0] = True
    ok = ~(mask & ~match[None, :]).any(-1)  # [n+1] every node on the path from the root matched
    live = ok[par[0].clamp(min=0)] & (par[0] >= 0)  # drafts whose parent was reached
    past = int(bool((live & (L + depth - 1 >= len(full))).any()))
    return [x - 1 for x in path[0].tolist()[1:] if x >= 0], past


def _params(req: dict[str, Any]):
    from specdec.datamodel.sampling_params import SamplingParams

    return SamplingParams(temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"], min_p=req["min_p"],
                          seed=req["seed"], max_tokens=req["max_tokens"])


# ---------------------------------------------------------------------------------------------- the run
def build(rc, meta: dict[str, Any], expected: bool) -> tuple[Replayer, LazyTarget, dict[str, Any]]:
    """The proposer through the registry (as specdec.spec_decode.builder builds it), in Top1Proposer."""
    from specdec.experiment.compose import speculative_config
    from specdec.spec_decode.builder import check_parts, make_proposer
    from specdec.spec_decode.config import parse_speculative_config
    from specdec.spec_decode.registry import resolve
    from specdec.spec_decode.top1_proposer import Top1Proposer

    spec = speculative_config(rc)
    if spec is None:
        raise ValueError("specdec.experiment.replay: no drafter to replay; pick one, e.g. proposer=ngram (and "
                         "proposer.num_speculative_tokens=...)")
    cfg = parse_speculative_config(spec)
    parts = check_parts(cfg, resolve("proposer", cfg.method), rc.max_model_len)  # as the builder checks them
    shape = parts.shape
    if shape is not None and expected:
        raise ValueError(f"specdec.experiment.replay: scorer={cfg.scorer} with a trace at temperature > 0: the expected "
                         "acceptance is computed for chains only; use scorer=mqa")
    target = LazyTarget(meta)
    proposer = make_proposer(parts.proposer, target, cfg)
    feats = proposer.features
    if feats is not None and list(feats.layers) != list(meta.get("feature_layers") or []):
        raise ValueError(f"specdec.experiment.replay: {type(proposer).__name__} reads target layers {list(feats.layers)} but the "
                         f"trace recorded {meta.get('feature_layers')}; record it again with trace_features=true "
                         f"trace_layers={list(feats.layers)} (plain run) or with this proposer")
    if feats is not None and not meta.get("features"):
        raise ValueError(f"specdec.experiment.replay: {type(proposer).__name__} reads the target's features and the trace has "
                         "none; record it with trace=true trace_features=true trace_features_dtype=float32")
    k = 1 if expected else cfg.num_speculative_tokens
    top1 = Top1Proposer(proposer, k, rc.max_model_len, target.vocab_size, cfg.disable_by_batch_size, shape)
    policy, cost = parts.policy, None
    if policy is not None and policy.needs_cost and not expected:
        cost = policy_cost(policy, meta)
    return Replayer(top1, feats, policy=None if expected else policy, cost=cost), target, spec


def policy_cost(policy, meta: dict[str, Any]):
    """The cost table a replayed policy decides from: its ``cost_table`` file, else the traced run's (meta.json)."""
    from specdec.spec_decode.cost_model import CostModel

    if policy.cost_table and Path(policy.cost_table).exists():
        return CostModel.load(policy.cost_table)
    if meta.get("cost_table"):
        return CostModel.from_dict(meta["cost_table"])
    raise ValueError(f"specdec.experiment.replay: speculation_policy {type(policy).__name__} decides from the engine's "
                     "cost table, and neither policy_options.cost_table names an existing file nor does the trace hold "
                     "one; give ++proposer.policy_options.cost_table=<a table a live run wrote>, or record the trace "
                     "with that policy (its meta.json then holds the table)")


def replay(cfg: Any) -> ReplaySummary:
    from specdec.experiment.compose import parse_config, to_container
    from specdec.experiment.run import hydra_output_dir
    from specdec.experiment.trace import load_trace

    t0 = time.perf_counter()
    raw = {k: v for k, v in to_container(cfg).items() if k not in ("hydra", "experiment")}
    run_dir = raw.pop("run_dir", None)
    if not run_dir or run_dir == "???":
        raise ValueError("specdec.experiment.replay: give the run directory whose trace to replay: "
                         "python -m specdec.replay <run dir> proposer=ngram ...")
    trace = load_trace(run_dir)
    meta = trace.meta
    overrides = task_overrides()
    from_trace = [o for o in overrides or [] if o.lstrip("+~").split("=", 1)[0].split(".")[0] in FROM_TRACE]
    if from_trace:  # the replay takes them from the recording: they used to be recorded in its summary, unused
        raise ValueError(f"specdec.replay: {', '.join(from_trace)}: a replay takes the model, its context, the seed, "
                         "the prompts, their turns and their sampling from the trace; drop them (record another trace "
                         "to change them)")
    raw = inherit_drafter(raw, meta.get("config") or {}, overrides)
    raw.update(model={**raw.get("model", {}), "name": meta["model"], "dtype": meta["dtype"]},
               max_model_len=meta["max_model_len"], seed=meta.get("seed", 0), debug=False, trace=False)
    rc = parse_config(raw)
    torch.manual_seed(rc.seed)
    reqs = trace.request_rows()
    expected = any(r["temperature"] > 0 for r in reqs)
    if expected and not all(r["temperature"] > 0 for r in reqs):
        raise ValueError(f"specdec.experiment.replay: trace {trace.path} mixes greedy and sampled requests; replay one kind")
    rep, target, spec = build(rc, meta, expected)
    dtype = trace_dtype(meta)
    from specdec.datamodel.metrics import sum_counts

    records: list[RequestRecord] = []
    by_question: dict[str, RequestRecord] = {}
    lo, hi = [], []
    for seq_id, r in enumerate(reqs):
        if r["finish_reason"] == "error":
            rep.notes.append(f"request {r['request_id']} finished with an error in the recording: skipped")
            continue
        feats = trace.features_of(r["request_id"]).to(dtype) if rep.features is not None else None  # [n, F]
        if expected:
            a, b = rep.expected(r["request_id"], seq_id, r, feats, trace.topn_of(r["request_id"]))
            lo.append(a)
            hi.append(b)
            continue
        counts, drafted = rep.greedy(r["request_id"], seq_id, r, feats)
        rec = by_question.get(r["question_id"])  # one record per question, its turns summed (as specdec.experiment.run)
        if rec is None:
            rec = by_question[r["question_id"]] = RequestRecord(
                question_id=r["question_id"], category=r["category"], num_prompt_tokens=0, num_generated_tokens=0,
                seconds=0.0, baseline_seconds=None, finish_reason=None, text="", greedy_match=None)
            records.append(rec)
        rec.num_prompt_tokens += len(r["prompt_ids"])
        rec.num_generated_tokens += len(r["output_ids"])
        rec.finish_reason = r["finish_reason"]
        rec.acceptance_counts = sum_counts([rec.acceptance_counts, counts]) if rec.acceptance_counts else counts
        rec.num_draft_tokens += drafted
    info = dict(trace=str(trace.path), mode="expected" if expected else "greedy", requests=len(reqs), steps=rep.steps,
                steps_past_recording=rep.past, target_loaded=target.loaded, notes=rep.notes,
                wall_time_s=time.perf_counter() - t0)
    if rep.cost is not None and rep.modelled_s > 0:  # what the cost table says these steps take, batch 1
        info["modelled_tokens_per_s"] = rep.emitted / rep.modelled_s
    config = {**msgspec.to_builtins(rc), "run_dir": str(run_dir)}
    if expected:
        summary = expected_summary(config, spec["num_speculative_tokens"], reqs, lo, hi, info)
    else:
        summary = greedy_summary(rc, config, records, rep.top1.max_path, info)
    if not expected:
        summary.speculation_policy = spec.get("speculation_policy", "static")
        summary.chosen_k_histogram = {str(k): n for k, n in sorted(rep.chosen.items())}
    out_dir = Path(rc.output_dir or hydra_output_dir() or Path.cwd())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    write_summary(summary, path)
    log.info("replay of %s: tau=%s acceptance_rate=%s (%d steps, %.2f s)", trace.path, summary.mean_acceptance_length,
             summary.acceptance_rate, rep.steps, info["wall_time_s"])
    print(path)  # last line of stdout: the summary's path
    return summary


def trace_dtype(meta: dict[str, Any]) -> torch.dtype:
    """The recorded run's weight dtype (resolved; a trace written with dtype "auto" by older code: this CPU's)."""
    from specdec.engine.loader import auto_dtype

    return auto_dtype()[0] if meta["dtype"] == "auto" else getattr(torch, meta["dtype"])


def task_overrides() -> list[str] | None:
    """The command line's overrides of this job (Hydra), None outside Hydra (a plain dict holds only what the
    caller gave)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001 - not under Hydra
        return None


def inherit_drafter(raw: dict[str, Any], traced: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """A replay that names no proposer replays the traced run's own: its proposer, scorer, verifier and kernel
    groups, with what this command line sets on top (``specdec.replay RUN proposer.num_speculative_tokens=2``).
    A traced plain run has no drafter to inherit (the caller then asks for one)."""
    from specdec.experiment.compose import SPEC_GROUPS

    def names_none(node: dict[str, Any]) -> bool:
        return not node.get("_target_") and node.get("method") in (None, "none")

    if not names_none(raw.get("proposer") or {}) or names_none(traced.get("proposer") or {}):
        return raw
    given = None if overrides is None else [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    out = dict(raw)
    for group in SPEC_GROUPS:
        mine = raw.get(group) or {}
        if given is not None and group in given and group != "proposer":
            continue  # re-chosen on this command line (scorer=tree): this run's group as composed
        if given is not None:
            keys = [k for k in mine if f"{group}.{k}" in given]
        elif group == "proposer":  # no command line known (compose API): the keys proposer=none does not set
            keys = [k for k in mine if mine[k] != {"num_speculative_tokens": 0}.get(k)]
        else:
            keys = []  # ... and the traced run's scorer, verifier and kernel
        if group == "proposer":
            keys = [k for k in keys if k not in ("_target_", "method")]
        out[group] = {**(traced.get(group) or {}), **{k: mine[k] for k in keys}}
    log.info("replay: the traced run's drafter (%s), with this command line's %s on top",
             traced["proposer"].get("_target_") or traced["proposer"].get("method"),
             [o for o in (overrides or []) if o.lstrip("+~").startswith(SPEC_GROUPS)] if overrides is not None
             else {g: raw.get(g) for g in SPEC_GROUPS if raw.get(g)})
    return out


def greedy_summary(rc, config: dict[str, Any], records: list[RequestRecord], k: int, info) -> ReplaySummary:
    from specdec.experiment.data import SPEC_BENCH_TASKS
    from specdec.datamodel.metrics import per_position, sum_counts
    from specdec.experiment.run import _category
    from specdec.experiment.theory import Theory

    by_cat: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_cat.setdefault(r.category, []).append(r)
    overall = _category(records, True, k)
    counts = sum_counts([r.acceptance_counts for r in records])
    return ReplaySummary(
        config=config, num_prompts=len(records), num_generated_tokens=overall.num_generated_tokens,
        mean_acceptance_length=overall.mean_acceptance_length, acceptance_rate=overall.acceptance_rate,
        acceptance_per_position=per_position(counts), tokens_per_s=None, baseline_tokens_per_s=None, speedup=None,
        per_category={c: _category(rs, True, k) for c, rs in by_cat.items()}, greedy_mismatches=None,
        wall_time_s=info["wall_time_s"], requests=records,
        per_task={t: _category([r for r in records if r.category in cats], True, k)
                  for t, cats in SPEC_BENCH_TASKS.items() if any(r.category in cats for r in records)},
        **{f: getattr(overall, f) for f in Theory.__struct_fields__}, replay=info,
        components={"proposer": config["proposer"].get("_target_") or str(config["proposer"].get("method"))},
    )


def expected_positions(alphas: list[list[float]], k: int) -> list[float]:
    """E[share of steps accepting draft position i], i = 1..k: the mean over start positions t (with k
    recorded positions after them) of prod_{j<i} alpha_{t+j}."""
    sums, n = [0.0] * k, 0
    for a in alphas:
        for t in range(len(a) - k + 1):
            reach = 1.0
            for i in range(k):
                reach *= a[t + i]
                sums[i] += reach
            n += 1
    return [s / n for s in sums] if n else []


def expected_summary(config, k: int, reqs, lo: list[list[float]], hi: list[list[float]], info) -> ReplaySummary:
    from specdec.experiment.theory import theory, tau_product

    flat_lo, flat_hi = [x for a in lo for x in a], [x for a in hi for x in a]
    pos_lo, pos_hi = expected_positions(lo, k), expected_positions(hi, k)
    alpha = sum(flat_lo) / len(flat_lo) if flat_lo else None
    alphas = [pos_lo[0]] + [pos_lo[i] / pos_lo[i - 1] if pos_lo[i - 1] else None for i in range(1, len(pos_lo))] \
        if pos_lo else []
    info = {**info, "alpha_lower": alpha, "alpha_upper": sum(flat_hi) / len(flat_hi) if flat_hi else None,
            "tau_lower": 1 + sum(pos_lo), "tau_upper": 1 + sum(pos_hi), "acceptance_per_position_upper": pos_hi,
            "positions": len(flat_lo)}
    th = theory([], k)
    return ReplaySummary(
        config=config, num_prompts=len({r["question_id"] for r in reqs}),
        num_generated_tokens=sum(len(r["output_ids"]) for r in reqs), mean_acceptance_length=1 + sum(pos_lo),
        acceptance_rate=sum(pos_lo) / k if pos_lo else None, acceptance_per_position=pos_lo, tokens_per_s=None,
        baseline_tokens_per_s=None, speedup=None, per_category={}, greedy_mismatches=None,
        wall_time_s=info["wall_time_s"], replay=info,
        **{**msgspec.structs.asdict(th), "alpha_per_position": alphas, "alpha_iid": alpha,
           "predicted_tau": tau_product(alphas) if alphas else None},
    )


# ---------------------------------------------------------------------------------------------- Hydra
def _argv(argv: list[str]) -> list[str]:
    """``<run dir>`` as a bare argument -> ``run_dir=<absolute path>`` (Hydra takes key=value only), and Hydra's
    flags first (its parser wants the overrides together: ``<run dir> -m k=1,2`` must still work)."""
    takes_value = {"-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "--info", "-p",
                   "--package", "--experimental-rerun", "-c", "--cfg"}
    flags, overrides, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-"):
            flags.append(a)
            if a in takes_value and i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
        else:
            overrides.append(a if "=" in a else f"run_dir={Path(a).resolve()}")
        i += 1
    dirs = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == "run_dir"]
    if len(dirs) > 1:  # Hydra kept the last one, and the others were dropped without a word
        raise SystemExit(f"specdec.replay: one run directory per replay; got {len(dirs)} ({', '.join(dirs)}); "
                         "replay them one by one")
    return flags + overrides


def main() -> None:
    import hydra

    from specdec.experiment.run import CONF_DIR

    from specdec.experiment.compose import open_options

    sys.argv[1:] = open_options(_argv(sys.argv[1:]))

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="replay")
    def _main(cfg) -> None:
        # imported by name: under `python -m specdec.replay` this module is __main__, and a multirun's worker
        # processes (joblib) would otherwise rebuild ReplaySummary from a pickled copy of __main__
        from specdec.experiment.replay import replay as replay_by_name

        replay_by_name(cfg)

    _main()


if __name__ == "__main__":
    main()
