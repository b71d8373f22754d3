"""SpecDecodeWorker: one speculative step, propose -> score -> verify, on an ExecuteModelRequest.

Prefill steps and steps where nothing was proposed run the plain worker. After verification it rolls the
target (and, through `Proposer.verified`, the draft) back past rejected positions and threads the
target's hidden states (HiddenStates) to the next step, including the bonus-token expansion.
It knows nothing about requests' text, stop conditions or scheduling: the step loop handles those.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from specdec.interfaces import GroupStepOutput, SpeculativeScorer, StepOutput, Worker
from specdec.sequence import ExecuteModelRequest, HiddenStates, Logprob
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.worker import PlainWorker, nan_error


@dataclass
class SpecSnapshot:
    """What a speculative step may change, taken before it (see SpecDecodeWorker.restore)."""

    seq_ids: list[int]  # the step's sequences
    target: Any  # PlainWorker.snapshot: the target's KV lengths and slots
    hidden_states: HiddenStates | None  # a copy: the rows threaded into this step
    seq_ids_with_bonus: set[int]
    proposer: Any  # Proposer.snapshot: the draft's own state


class SpecDecodeWorker(Worker):
    def __init__(self, plain: PlainWorker, proposer: Top1Proposer, scorer: SpeculativeScorer, verifier) -> None:
        self.plain = plain  # the target engine, its slot table and the plain sampler
        self.target = plain.engine
        self.top1 = proposer
        self.scorer = scorer
        self.verifier = verifier  # a specdec.verify sampler: .verify(logits, draft ids, draft probs, params, gens)
        self.hidden_states: HiddenStates | None = None
        self.seq_ids_with_bonus: set[int] = set()

    def num_free_slots(self) -> int:
        return self.target.num_free_slots()

    def free_requests(self, request_ids: list[str]) -> None:
        freed: set[int] = set()
        for rid in request_ids:
            for seq_id in self.plain.slots.seqs_of.get(rid, []):
                self.top1.proposer.free(seq_id)
                self.seq_ids_with_bonus.discard(seq_id)
                freed.add(seq_id)
            self.plain.slots.free(rid)
        if freed and self.hidden_states is not None:
            self.hidden_states.discard(freed)

    # ----------------------------------------------------------------- transactions
    def snapshot(self, seq_group_metadata_list) -> "SpecSnapshot":
        seq_ids = [s for m in seq_group_metadata_list for s in m.seq_data]
        hs = self.hidden_states
        return SpecSnapshot(seq_ids, self.plain.snapshot(seq_group_metadata_list),
                            None if hs is None else hs.copy(), set(self.seq_ids_with_bonus),
                            self.top1.proposer.snapshot(seq_ids))

    def restore(self, snapshot: "SpecSnapshot") -> None:
        self.top1.proposer.restore(snapshot.seq_ids, snapshot.proposer)
        self.plain.restore(snapshot.target)
        # copies: prune/expand rewrite a HiddenStates' rows in place, and a snapshot may be restored twice
        self.hidden_states = None if snapshot.hidden_states is None else snapshot.hidden_states.copy()
        self.seq_ids_with_bonus = set(snapshot.seq_ids_with_bonus)
        self.top1.hidden_states = None

    # ----------------------------------------------------------------- steps
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> StepOutput:
        self.free_requests(execute_model_req.finished_requests_ids)
        metas = execute_model_req.seq_group_metadata_list
        if any(m.is_prompt for m in metas) or execute_model_req.num_lookahead_slots == 0:
            return self._run_no_spec(execute_model_req)
        hs = self.hidden_states
        if hs is not None:
            hs.prune(metas)
            bonus = self.seq_ids_with_bonus & set(hs.seq_ids)
            if bonus:
                hs.expand_with_bonus_tokens(bonus)
        self.top1.hidden_states = hs
        t0 = time.perf_counter()
        proposals = self.top1.get_spec_proposals(execute_model_req, set(self.seq_ids_with_bonus))
        t1 = time.perf_counter()
        # Even with no proposal anywhere, verify through the same path: a seeded request then draws its
        # randomness the same way whatever else is in the batch (the plain sampler draws differently).
        scores = self.scorer.score_proposals(execute_model_req, proposals)
        t2 = time.perf_counter()
        out = self._verify(metas, proposals, scores)
        t3 = time.perf_counter()
        out.times.update(propose=t1 - t0, score=t2 - t1, verify=t3 - t2)
        return out

    def _run_no_spec(self, req: ExecuteModelRequest) -> StepOutput:
        """A prefill or a decode step without proposals: plain forward + sample, hidden states updated."""
        out, hidden = self.plain.forward_and_sample(req.seq_group_metadata_list)  # hidden [B, D]
        metas = req.seq_group_metadata_list
        if self.hidden_states is None:
            self.hidden_states = HiddenStates(hidden_states=hidden, seq_group_metadata_list=metas)
        else:  # new sequences are appended, known ones get their row replaced (a fix over the seed)
            self.hidden_states.update(hidden, metas)
        for meta in metas:
            self.seq_ids_with_bonus.discard(next(iter(meta.seq_data)))
        return out

    def _verify(self, metas, proposals, scores) -> StepOutput:
        B, k = proposals.proposal_token_ids.shape
        lens = proposals.proposal_lens  # [B]
        logits = scores.logits  # [B, k+1, V]
        # A row whose target logits are not finite must not poison the others (multinomial raises on NaN).
        bad = ~torch.isfinite(logits).all(dim=-1).all(dim=-1)  # [B]
        if bad.any():
            logits = torch.where(bad[:, None, None], torch.zeros_like(logits), logits)
        params = [m.sampling_params for m in metas]
        gens = [m.state.generator if m.state is not None else None for m in metas]
        out_ids = self.verifier.verify(logits, proposals.proposal_token_ids, proposals.proposal_probs, params, gens)
        emitted_n = (out_ids != -1).sum(dim=1)  # [B] accepted + 1
        accepted = torch.minimum(emitted_n - 1, lens)  # [B]
        out_list = out_ids.tolist()
        acc_list = accepted.tolist()
        lens_list = lens.tolist()
        bad_list = bad.tolist()
        chosen_lp = scores.logprobs.gather(2, out_ids.clamp(min=0)[..., None])[..., 0].tolist()  # [B, k+1]
        results = []
        last_rows, second_rows = [], []
        self.seq_ids_with_bonus = set()
        for b, meta in enumerate(metas):
            seq_id, data = next(iter(meta.seq_data.items()))
            a = acc_list[b]
            base = data.get_len()  # tokens before this step; the target held base-1 of them
            self.target.rollback(self.plain.slots.slot_of[seq_id], base + a)
            self.top1.proposer.verified(seq_id, base + a)
            last_rows.append(a)
            second_rows.append(max(a - 1, 0))
            if bad_list[b]:
                results.append(GroupStepOutput([], error=nan_error(meta.request_id)))
                continue
            toks = out_list[b][: a + 1]
            lps = [{t: Logprob(logprob=chosen_lp[b][j], rank=None)} for j, t in enumerate(toks)]
            results.append(GroupStepOutput(toks, lps, num_proposed=lens_list[b], num_accepted=a))
            if a == k and lens_list[b] == k:
                self.seq_ids_with_bonus.add(seq_id)
        idx = torch.arange(B)
        hidden = scores.hidden_states  # [B, k+1, D]
        self.hidden_states = HiddenStates(
            hidden_states=hidden[idx, torch.tensor(last_rows)],
            seq_group_metadata_list=metas,
            second_last_token_hidden_states=hidden[idx, torch.tensor(second_rows)],
        )
        return StepOutput(results)
