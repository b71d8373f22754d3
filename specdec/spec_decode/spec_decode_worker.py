"""SpecDecodeWorker: one speculative step, propose -> score -> verify -> commit, chains and trees alike.

A chain is a tree whose parents are i-1 (specdec/interfaces.py), so there is one step:
  Top1Proposer.get_spec_proposals -> SpeculativeProposals [B, N] (a row that cannot draft gets 0 nodes)
  scorer.score_proposals          -> SpeculativeScores: one target forward over [pending, nodes] per row
  verifier.verify_proposals       -> Verdict: the accepted root-to-node path + one final token per row
  commit                          -> the target's KV keeps the accepted path (a chain: rollback; a tree:
                                     compact it into place), the proposer is told (Proposer.accepted), and
                                     the path's features join HiddenStates for the next step.
Prefill steps (and steps with num_lookahead_slots == 0) run the plain worker, and so does a decode step where
the speculation policy chose 0 for every row and no row is seeded (_plain_decode: no proposer call, padding or
verification; a seeded row keeps the speculative path, whose draws do not depend on the batch), or reuses such a
choice without choosing (SpeculationPolicy.reuses_zeros: no limits, choice or new shadow draft that step). Rows
that chose 0 under a proposer with free drafts get shadow drafts for the policy's estimates (policy.py). The
target's features reach the proposer only through HiddenStates, on ``ExecuteModelRequest.previous_hidden_states``:
every forward asks the target for the proposer's FeatureSpec layers, and each committed token's row is kept
(up to FeatureSpec.history per sequence) in a FeatureStore, per sequence, until the proposer reads it: a step
builds the HiddenStates of its own batch only.
Conventions: ``num_proposed`` = nodes scored, ``num_accepted`` = the accepted path's length.
Multi-step decoding (specdec/core/multi_step.py): decode_steps runs a block of these steps for greedy chain
rows with argmax verification on tensors and the outputs built once per block (None elsewhere).
It knows nothing about requests' text, stop conditions, scheduling, or how drafts are made.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.interfaces import (GroupStepOutput, SpeculativeProposals, SpeculativeScorer, SpeculativeScores,
                                SpeculativeVerifier, StepOutput, Verdict, Worker)
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.spec_decode.cost_model import CostModel, MismatchedTable, calibrate, cost_table_key
from specdec.spec_decode.feature_store import FeatureStore
from specdec.spec_decode.policy import (BatchView, ShadowDrafts, SpeculationPolicy, StaticPolicy, StepResult,
                                        node_outcomes, report_shadow)
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.sampling.logprobs import emitted_logprobs
from specdec.verify.tree import ends_at_leaf
from specdec.sampling.logits_process import process_tree_logits
from specdec.sampling.guided import GrammarMasks, guide_proposals
from specdec.core.plain_worker import PlainWorker, nan_error
from specdec.datamodel.sequence import Logprob
from specdec.sampling.logits_process import active_processor_fields
from specdec.verify.chain import RejectionSampler

logger = logging.getLogger(__name__)


@dataclass
class SpecSnapshot:
    """What a speculative step may change, taken before it (see SpecDecodeWorker.restore)."""

    seq_ids: list[int]  # the step's sequences
    target: Any  # PlainWorker.snapshot: the target's KV lengths and slots
    hidden_states: FeatureStore | None  # a copy: the rows held before this step
    seq_ids_with_bonus: set[int]
    proposer: Any  # Proposer.snapshot: the draft's own state


class SpecDecodeWorker(Worker):
    speculative = True

    def __init__(self, plain: PlainWorker, proposer: Top1Proposer, scorer: SpeculativeScorer,
                 verifier: SpeculativeVerifier, policy: SpeculationPolicy | None = None) -> None:
        self.plain = plain  # the target engine, its slot table and the plain sampler
        self.target = plain.engine
        self.top1 = proposer
        self.scorer = scorer
        self.verifier = verifier
        self.features = proposer.proposer.features  # FeatureSpec | None: what the proposer reads
        self.layers = () if self.features is None else self.features.layers
        self.hidden_states: FeatureStore | None = None  # unread feature rows of every live sequence
        self.seq_ids_with_bonus: set[int] = set()
        self.observers = plain.observers  # read-only watchers of every step (traces): see PlainWorker
        self.policy = policy if policy is not None else StaticPolicy()  # how much each row drafts per step
        self.cost = CostModel()  # the engine's step costs (measured when the policy needs them)
        self.chosen_counts: dict[int, int] = {}  # the policy's number (k / budget) -> row-steps that got it
        self.shadows = ShadowDrafts()  # drafts of rows that chose 0, until the emitted tokens decide them (policy.py)
        self.plain_steps = 0  # decode steps run by _plain_decode (every row chose 0)
        self.spec_steps = 0  # decode steps run by _spec_step (one batch step each, whatever its rows)
        self.decode_blocks = 0  # blocks run by decode_steps' fast loop (multi-step decoding)
        # seq id -> the decode step (spec_steps + plain_steps) in which it last drafted: a row that did not draft in
        # the step before is not in its steady state (_observe)
        self._drafted_at: dict[int, int] = {}
        self._tail_clock = 0  # steps that had a candidate tail shadow (_start_shadows)
        self._classes: list[int] | None = None  # the step's draft classes (execute_model), None outside a step
        if self.policy.needs_cost:  # at start-up, while every KV slot is free: calibrate needs a scratch slot, and
            self.cost = self._cost_table()  # with max_num_seqs = 1 the running request would hold the only one

    def num_free_slots(self) -> int:
        return self.target.num_free_slots()

    def release(self) -> None:
        self.plain.release()

    def free_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for seq_id in self.plain.slots.seqs_of.get(rid, []):
                self.top1.proposer.free(seq_id)
                self.policy.free(seq_id)
                self.shadows.free(seq_id)
                self._drafted_at.pop(seq_id, None)
                self.seq_ids_with_bonus.discard(seq_id)
                if self.hidden_states is not None:
                    self.hidden_states.discard({seq_id})
            self.plain.slots.free(rid)

    # ----------------------------------------------------------------- transactions
    def snapshot(self, seq_group_metadata_list) -> SpecSnapshot:
        seq_ids = [s for m in seq_group_metadata_list for s in m.seq_data]
        hs = self.hidden_states
        return SpecSnapshot(seq_ids, self.plain.snapshot(seq_group_metadata_list), None if hs is None else hs.copy(),
                            set(self.seq_ids_with_bonus), self.top1.proposer.snapshot(seq_ids))

    def restore(self, snapshot: SpecSnapshot) -> None:
        self.top1.proposer.restore(snapshot.seq_ids, snapshot.proposer)
        self.plain.restore(snapshot.target)
        # a copy: a snapshot may be restored twice, and the rows are rewritten as steps run
        self.hidden_states = None if snapshot.hidden_states is None else snapshot.hidden_states.copy()
        self.seq_ids_with_bonus = set(snapshot.seq_ids_with_bonus)
        self.shadows.clear()  # estimates only: a re-run step must not see its tokens twice

    # ----------------------------------------------------------------- steps
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> StepOutput:
        self.free_requests(execute_model_req.finished_requests_ids)
        metas = execute_model_req.seq_group_metadata_list
        if any(m.is_prompt for m in metas) or execute_model_req.num_lookahead_slots == 0:
            out, feats, qlens = self.plain.forward_and_sample(metas, self.layers)  # tells the observers
            self._keep_rows(feats, [m.get_first_seq_id() for m in metas], qlens)
            self.seq_ids_with_bonus -= {m.get_first_seq_id() for m in metas}
            for m in metas:  # a recompute's prefill: its shadow would see tokens again
                self.shadows.drop(m.get_first_seq_id())
            return out
        tp = time.perf_counter()
        seq_ids = [m.get_first_seq_id() for m in metas]  # [B]
        self._classes = None  # this step's draft classes (BatchView.classes), for the StepResult
        if self.policy.reuses_zeros(seq_ids) and self._may_go_plain(metas):  # a held all-zero choice
            out = self._plain_decode(metas, [0] * len(metas), time.perf_counter() - tp)
            if self.shadows:
                self._resolve_shadows(seq_ids, out)
            return out
        held = None if self.hidden_states is None else self.hidden_states.held()  # a sequence without rows cannot draft
        limits = self.top1.limits(execute_model_req, held)
        if self.policy.takes_classes:  # a free-draft proposer's confidence per row; class 0 drafts nothing
            self._classes = self.top1.draft_classes(execute_model_req, limits)
            if self._classes is not None:
                limits = [lim if c else 0 for lim, c in zip(limits, self._classes)]
        ks = self._choose(execute_model_req, limits, seq_ids)
        if self.policy.takes_shadow and self.top1.free_drafts:
            self._start_shadows(execute_model_req, limits, ks, seq_ids)
        if not any(ks) and self._may_go_plain(metas):
            out = self._plain_decode(metas, ks, time.perf_counter() - tp)
        else:
            out = self._spec_step(execute_model_req, ks, tp)
        if self.shadows:
            self._resolve_shadows(seq_ids, out)
        return out

    def _spec_step(self, execute_model_req: ExecuteModelRequest, ks: list[int], tp: float) -> StepOutput:
        """Propose -> score -> verify -> commit with the policy's ``ks`` (``tp``: when choosing began)."""
        metas = execute_model_req.seq_group_metadata_list
        self.spec_steps += 1
        t0 = time.perf_counter()
        if self.hidden_states is not None:  # the batch's rows, built only for a step that reads them
            execute_model_req.previous_hidden_states = self.hidden_states.select([m.get_first_seq_id() for m in metas])
        proposals = self.top1.get_spec_proposals(execute_model_req, set(self.seq_ids_with_bonus), ks)
        if all(m.sampling_params.temperature == 0.0 for m in metas):  # nothing is drawn: the padding can go
            proposals = proposals.narrowed()
        if self.hidden_states is not None:  # the rows the proposer read are spent
            self.hidden_states.discard(set(proposals.drafted_seq_ids))
        # guided_decoding: drafts its grammar forbids end their branch here, before scoring; masks for every position
        grammars = [m.state.grammar if m.state is not None else None for m in metas]
        proposals, grammar = guide_proposals(proposals, grammars, [m.first_seq_data() for m in metas],
                                             self.top1.vocab_size)
        t1 = time.perf_counter()
        # Even with no proposal anywhere, verify through the same path: a seeded request then draws its
        # randomness the same way whatever else is in the batch (the plain sampler draws differently).
        scores = self.scorer.score_proposals(execute_model_req, proposals)
        t2 = time.perf_counter()
        verdict = (self._verify(metas, proposals, scores) if grammar is None  # (a test spies on the 3-argument form)
                   else self._verify(metas, proposals, scores, grammar))
        out = self.commit(metas, proposals, scores, verdict, grammar)
        for g, kk in zip(out.outputs, ks):
            g.num_chosen = kk
            self.chosen_counts[kk] = self.chosen_counts.get(kk, 0) + 1
        for obs in self.observers:
            obs.spec_step(metas, proposals, scores, verdict, out)
        out.times.update(policy=t0 - tp, propose=t1 - t0, score=t2 - t1, verify=time.perf_counter() - t2)
        self._observe(metas, ks, proposals, verdict, out.times, grammar is not None)
        return out

    def _plain_decode(self, metas, ks: list[int], policy_s: float) -> StepOutput:
        """A decode step where every row chose 0 (none seeded): what the prefill branch runs, one plain forward and
        sample, told to the observers by forward_and_sample. Greedy rows emit the target's argmax as a 0-draft
        speculative step would; unseeded sampled rows draw from the same law (guided rows included: the plain
        sampler applies the same grammar masks, specdec/sampling/guided.py). Each fed token's feature row is kept
        (the next speculative step's proposer catches up from it), and no row ends at a bonus token."""
        t0 = time.perf_counter()
        out, feats, qlens = self.plain.forward_and_sample(metas, self.layers)  # tells the observers
        seq_ids = [m.get_first_seq_id() for m in metas]
        self._keep_rows(feats, seq_ids, qlens)
        self.seq_ids_with_bonus -= set(seq_ids)
        step_s = time.perf_counter() - t0
        B = len(metas)
        for g in out.outputs:
            g.num_chosen = 0
        self.chosen_counts[0] = self.chosen_counts.get(0, 0) + B
        self.plain_steps += 1
        out.times["policy"] = policy_s
        if self.policy.refresh_cost and self.cost.calibrated:  # what S = 0 costs on this path (cost_model.py)
            self.cost.observe_plain(B, step_s)
        self.policy.observe(StepResult(seq_ids, ks, [0] * B, [0] * B, out.times, classes=self._classes))
        return out

    @staticmethod
    def _may_go_plain(metas) -> bool:
        """No seeded row: a seeded request draws its randomness the same way whatever else is in the batch, which
        holds on the speculative path only (the plain sampler draws differently)."""
        return all(m.state is None or m.state.generator is None for m in metas)

    # ----------------------------------------------------------------- shadow drafts (policy.py)
    def _start_shadows(self, req: ExecuteModelRequest, limits: list[int], ks: list[int], seq_ids: list[int]) -> None:
        """Rows that could draft but chose 0 (and have no shadow pending): what they would have drafted now; then,
        for a policy that takes tail shadows, rows that chose below their limit (policy.py). ``seq_ids``: [B] the
        batch's."""
        most = self.policy.shadow_rows
        # rows at 0 first; then (a policy that takes them) tails of rows below their limit
        for tail in (False, True) if self.policy.tail_every else (False,):
            rows = [b for b, (lim, kk) in enumerate(zip(limits, ks))
                    if (0 < kk < lim if tail else lim and not kk) and seq_ids[b] not in self.shadows]
            if not rows or most == 0:
                continue
            if tail:  # every tail_every-th step that has candidates (the replay keeps the same clock)
                self._tail_clock += 1
                if self._tail_clock % self.policy.tail_every:
                    continue
            # at most the policy's shadow_rows in all, those asked longest ago first
            rows = [rows[i] for i in self.shadows.pick([seq_ids[b] for b in rows], most)]
            if most is not None:
                most -= len(rows)
            drafts = self.top1.shadow_drafts(req, rows, [limits[b] for b in rows])
            classes = self._classes
            for b, d in zip(rows, drafts):
                self.shadows.start(seq_ids[b], d, ks[b], None if classes is None else classes[b])

    def _resolve_shadows(self, seq_ids: list[int], out: StepOutput) -> None:
        """The step's emitted tokens against the pending shadow drafts ([B] ``seq_ids``, the batch's); each resolved
        one goes to the policy."""
        for s, g in zip(seq_ids, out.outputs):
            if s not in self.shadows:
                continue
            if g.error is not None:
                self.shadows.drop(s)
                continue
            report_shadow(self.policy, s, self.shadows.emitted(s, g.token_ids))

    # ----------------------------------------------------------------- multi-step (specdec/core/multi_step.py)
    def decode_steps(self, metas, num_steps: int,
                     limits: list,  # [B] (budget, stop ids) per row: multi_step.row_limits
                     ) -> tuple[list[list[GroupStepOutput]], dict[str, float]] | None:
        """Up to ``num_steps`` speculative steps over greedy chain rows (Worker.decode_steps): propose and score
        as execute_model does, verify by comparing the drafts with the target's argmax on tensors, commit the KV
        (rollback) and the proposer, and build the GroupStepOutputs once at the end. A row leaves the block once
        it emitted ``budget`` tokens, one of its stop ids or a non-finite row. The rows' SequenceData advance
        in place (the next step's proposer and scorer read them) and are put back before it returns: the
        engine replays the outputs. None where it does not apply (a subclass's execute_model, observers, the
        proposer reads features, trees, a policy that needs the queue size, a verifier other than
        RejectionSampler, logprobs, processors, guided decoding, a non-greedy row): then execute_model per step."""
        if type(self).execute_model is not SpecDecodeWorker.execute_model:
            return None
        top1 = self.top1
        if (self.observers or self.features is not None or top1.shape is not None
                or type(self.policy) is not StaticPolicy or top1.disable_by_batch_size is not None
                or type(self.verifier) is not RejectionSampler or any(lim is None for lim in limits)
                or any(m.is_prompt or (m.state is not None and m.state.grammar is not None)
                       or m.sampling_params.temperature != 0.0 or m.sampling_params.wants_logprobs
                       or active_processor_fields(m.sampling_params) for m in metas)):
            return None
        self.decode_blocks += 1
        B, k = len(metas), top1.k
        seqs = [m.first_seq() for m in metas]  # [B] (seq id, SequenceData)
        slots = [self.plain.slots.slot_of[sid] for sid, _ in seqs]
        budget = [lim[0] for lim in limits]
        stops = [lim[1] for lim in limits]
        live = [b for b in range(B) if budget[b] > 0]
        checkpoints = [d.checkpoint() for _, d in seqs]
        per: list[list[GroupStepOutput]] = [[] for _ in range(B)]
        times = {"policy": 0.0, "propose": 0.0, "score": 0.0, "verify": 0.0}
        bonus = self.seq_ids_with_bonus
        arange = torch.arange(k + 1)
        try:
            for _ in range(num_steps):
                if not live:
                    break
                req = ExecuteModelRequest(seq_group_metadata_list=[metas[b] for b in live], num_lookahead_slots=k)
                tp = time.perf_counter()
                ks = top1.limits(req)
                t0 = time.perf_counter()
                proposals = top1.get_spec_proposals(req, set(bonus), ks)
                t1 = time.perf_counter()
                scores = self.scorer.score_proposals(req, proposals)
                t2 = time.perf_counter()
                logits, stats = scores.logits, scores.current_logit_stats()  # [R, k+1, V]
                if stats is not None:
                    argmax, lse, finite = stats.argmax.to(torch.long), stats.lse, stats.finite.all(-1)
                else:
                    argmax, lse = logits.argmax(-1), torch.logsumexp(logits, -1)  # [R, k+1]
                    finite = torch.isfinite(logits.sum(-1)).all(-1)
                argmax, nodes = argmax.cpu(), proposals.num_nodes  # [R, k+1], [R]
                # greedy verification: a draft is accepted while it equals the target's argmax before it
                match = (proposals.token_ids == argmax[:, :k]) & (arange[None, :k] < nodes[:, None])  # [R, k]
                n_acc = match.cumprod(1).sum(1)  # [R]
                lp = (logits.gather(-1, argmax[..., None].to(logits.device))[..., 0] - lse).float().cpu()  # [R, k+1]
                n_l, nodes_l, fin_l = n_acc.tolist(), nodes.tolist(), finite.tolist()
                toks_l, lp_l = argmax.tolist(), lp.tolist()
                bonus = set()
                keep = []
                for r, b in enumerate(live):
                    seq_id, data = seqs[b]
                    a, base = n_l[r], data.get_len()
                    self.target.rollback(slots[b], base + a)
                    top1.proposer.accepted(seq_id, base, list(range(a)))
                    if not fin_l[r]:
                        per[b].append(GroupStepOutput([], error=nan_error(metas[b].request_id)))
                        continue
                    toks = toks_l[r][: a + 1]
                    per[b].append(GroupStepOutput(toks, [{t: Logprob(logprob=v)} for t, v in zip(toks, lp_l[r])],
                                                  num_proposed=nodes_l[r], num_accepted=a, num_chosen=ks[r]))
                    self.chosen_counts[ks[r]] = self.chosen_counts.get(ks[r], 0) + 1
                    if a > 0 and a == nodes_l[r]:
                        bonus.add(seq_id)
                    for t in toks:
                        data.append_token_id(t, 0.0)
                    budget[b] -= len(toks)
                    if budget[b] > 0 and not stops[b].intersection(toks):
                        keep.append(b)
                t3 = time.perf_counter()
                step_times = dict(policy=t0 - tp, propose=t1 - t0, score=t2 - t1, verify=t3 - t2)
                for name, sec in step_times.items():
                    times[name] += sec
                self.policy.observe(StepResult([seqs[b][0] for b in live], ks, nodes_l, n_l, step_times))
                live = keep
        finally:
            for (_, d), cp in zip(seqs, checkpoints):
                d.restore(cp)
        self.seq_ids_with_bonus = bonus
        return per, times

    # ----------------------------------------------------------------- the speculation policy
    def _choose(self, req: ExecuteModelRequest, limits: list[int], seq_ids: list[int]) -> list[int]:
        """The policy's number per row (specdec/spec_decode/policy.py), within Top1Proposer's ``limits``; ``seq_ids``:
        [B] the batch's."""
        policy = self.policy
        if type(policy) is StaticPolicy:
            return limits
        if policy.needs_cost and not self.cost.calibrated:
            self.cost = self._cost_table()
        top1 = self.top1
        view = BatchView(seq_ids, limits,
                         tree=top1.shape is not None, depth=top1.max_path, num_waiting=req.num_waiting,
                         shadow=policy.takes_shadow and top1.free_drafts,
                         plain=self._may_go_plain(req.seq_group_metadata_list),
                         contexts=[m.first_seq_data().get_len() for m in req.seq_group_metadata_list],
                         classes=self._classes)
        return policy.choose(view, self.cost)

    def _cost_table(self) -> CostModel:
        """The policy's cost table file when it has one, else measured now on the target (saved to that file)."""
        path = self.policy.cost_table
        made_on = cost_table_key(self.target)
        if path and Path(path).exists():
            try:
                return CostModel.load(path, made_on=made_on)
            except MismatchedTable as e:  # measured elsewhere: this engine's own, the file left as it is
                logger.warning("%s; measuring this engine's table instead", e)
                return calibrate(self.target)
        cost = calibrate(self.target)
        if path and cost.calibrated:
            cost.save(path, made_on=made_on)
        return cost

    def _observe(self, metas, ks: list[int], proposals: SpeculativeProposals, verdict: Verdict,
                 times: dict[str, float], guided: bool = False) -> None:
        proposed, accepted = proposals.num_nodes.tolist(), verdict.num_accepted.tolist()
        tree = self.top1.shape is not None
        drafting = sum(1 for n in proposed if n)
        # The draft's price is learnt from steady steps only: every drafting row also drafted in the step before. A
        # row's first draft after its prompt, or after steps at 0, catches the proposer up over every token since (an
        # EAGLE head's forward over a 770-token prompt: ~39 ms against ~2 ms a step), and one such step in the EMA
        # priced drafting at 4.4 ms a row; the goodput policy then stopped drafting, so no steady step came to
        # correct it, and a whole run of long prompts decoded plainly (tau 1.01). Probes price their catch-up apart.
        step, seq_ids = self.spec_steps + self.plain_steps, [m.get_first_seq_id() for m in metas]
        steady = all(self._drafted_at.get(s) == step - 1 for s, n in zip(seq_ids, proposed) if n)
        for s, n in zip(seq_ids, proposed):
            if n:
                self._drafted_at[s] = step
        if self.policy.refresh_cost:
            row_ctx = sum(n * m.first_seq_data().get_len() for n, m in zip(proposed, metas)) if self.cost.ctx_slope else 0
            self.cost.observe(len(metas) + sum(proposed), len(metas), times["score"], times["propose"],
                              times["verify"], 0 if tree or not steady else sum(proposed),
                              drafting if tree and steady else 0, row_ctx)
        outcomes = None
        # every drafted node's fate (policy.node_outcomes), for a policy that reads them: its per-node estimates
        if tree and not guided and self.policy.takes_node_outcomes:
            whole = proposals.uncut or (proposals.token_ids, proposals.parents, proposals.num_nodes)
            toks, pars, counts = (x.tolist() for x in whole)
            paths, outs = verdict.accepted_paths, verdict.out.tolist()  # [B][a+1] root first; [B, N+1]
            outcomes = [node_outcomes(toks[b][:counts[b]], pars[b][:counts[b]], proposed[b],
                                      [x - 1 for x in paths[b][1:]],
                                      outs[b][: a + 1] if m.sampling_params.greedy else None)
                        for b, (m, a) in enumerate(zip(metas, accepted))]
        self.policy.observe(StepResult(seq_ids, ks, proposed, accepted, times, outcomes, self._classes))

    def _verify(self, metas, proposals: SpeculativeProposals, scores: SpeculativeScores,
                grammar: GrammarMasks | None = None) -> Verdict:
        logits = scores.logits  # [B, N+1, V]
        stats = scores.current_logit_stats()
        bad = scores.nonfinite_rows  # [B] a row whose logits are not finite must not poison the others
        if bad.any():  # verified on zeros (its verdict is dropped: commit reports an error for it)
            logits = torch.where(bad[:, None, None], torch.zeros_like(logits), logits)
            stats = None
        roots = torch.tensor([m.first_seq_data().get_last_token_id() for m in metas])
        params = [m.sampling_params for m in metas]
        gens = [m.state.generator if m.state is not None else None for m in metas]
        # penalties, biases and masks at every scored position, given that position's drafted prefix: the
        # verifier then targets the processed distribution, as plain sampling does (the raw logits stay in
        # ``scores`` for the reported logprobs)
        processed = process_tree_logits(logits, proposals, [m.first_seq_data() for m in metas], params)
        if grammar is not None:  # and guided_decoding's masks, last (specdec/sampling/guided.py)
            processed = grammar.apply(processed)
        if stats is not None and stats.valid_for(processed) and self.verifier.takes_target_argmax:
            return self.verifier.verify_proposals(processed, proposals, roots, params, gens, target_argmax=stats.argmax)
        return self.verifier.verify_proposals(processed, proposals, roots, params, gens)

    def commit(self, metas, proposals: SpeculativeProposals, scores: SpeculativeScores, verdict: Verdict,
               grammar: GrammarMasks | None = None) -> StepOutput:
        """Keep the accepted path in the target's KV, tell the proposer, thread the path's features on.
        ``grammar``: a guided row whose final token would come from a position its grammar left empty ends."""
        paths = verdict.accepted_paths  # [B][a+1] root-inclusive accepted nodes
        n_acc = [len(p) - 1 for p in paths]  # [B]
        bad = scores.nonfinite_rows  # [B] these finish with an error; their (non-finite) logprobs are not read
        stats = scores.current_logit_stats()
        lps = emitted_logprobs(scores.logits, verdict, [m.sampling_params for m in metas],  # raw rows of the path
                               None if stats is None or bad.any() else stats.lse)
        leaf = ends_at_leaf(proposals, verdict).tolist()
        nodes_n, bad_l, out_l = proposals.num_nodes.tolist(), bad.tolist(), verdict.out.tolist()
        results, rows, owners = [], [], []
        keep = self.features is not None  # the path's feature rows, for a proposer that reads them
        self.seq_ids_with_bonus = set()
        for b, meta in enumerate(metas):
            seq_id, data = meta.first_seq()
            a, base = n_acc[b], data.get_len()  # the target held base-1 tokens; the pending one is next
            path = paths[b]  # root-inclusive; ascending (a parent's index is below its child's)
            slot = self.plain.slots.slot_of[seq_id]
            # node i sits at cache index base-1+i; the path's leading nodes 1, 2, .., j0 are already in place
            j0 = next((j for j in range(a) if path[j + 1] != j + 1), a)
            if j0 == a:  # a prefix of the nodes (every chain): cut the rest
                self.target.rollback(slot, base + a)
                if keep:
                    rows.append(scores.hidden_states[b, : a + 1])  # [a+1, F] the pending token's and each accepted draft's
            else:  # move the rest of the path to base+j0, base+j0+1, ... and drop the others
                self.target.compact(slot, torch.tensor([x + base - 1 for x in path[j0 + 1 :]]), base + j0)
                if keep:
                    rows.append(scores.hidden_states[b, path])
            nodes = [x - 1 for x in path[1:]]
            self.top1.proposer.accepted(seq_id, base, nodes if grammar is None else grammar.proposer_nodes(b, nodes))
            owners += [seq_id] * (a + 1)
            if bad_l[b]:
                results.append(GroupStepOutput([], error=nan_error(meta.request_id)))
                continue
            no_token = None if grammar is None else grammar.error(b, verdict, meta.request_id)
            if no_token is not None:
                results.append(GroupStepOutput([], error=no_token))
                continue
            toks = out_l[b][: a + 1]
            results.append(GroupStepOutput(toks, lps[b], num_proposed=nodes_n[b], num_accepted=a))
            if leaf[b]:
                self.seq_ids_with_bonus.add(seq_id)
        if keep:
            self._add_rows(torch.cat(rows), owners)
        return StepOutput(results)

    def _keep_rows(self, feats: torch.Tensor, seq_ids: list[int], qlens: list[int]) -> None:
        """After a plain forward ([T, F] features, ``qlens`` tokens per sequence): every fed token's row."""
        self._add_rows(feats, [s for s, n in zip(seq_ids, qlens) for _ in range(n)])

    def _add_rows(self, feats: torch.Tensor, owners: list[int]) -> None:
        if self.features is None:
            return
        if self.hidden_states is None:
            self.hidden_states = FeatureStore()
        history = self.features.history
        self.hidden_states.extend(feats, owners, history)
