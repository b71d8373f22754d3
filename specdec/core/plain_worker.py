"""The plain (non-speculative) worker: one target forward and one sample per sequence per step.

It knows nothing about requests beyond what ExecuteModelRequest carries, and nothing about text.
It maps each sequence id to a KV slot of its engine; the slot holds every token but the last one, which
is the next step's input.

Shared prefills: in a prefill step, a sequence whose tokens equal an earlier sequence's of the same batch
(the n children of one request, specdec/core/parallel.py) is not fed. The earlier one's forward serves it:
its slot gets that prompt's KV by ``ModelEngine.copy_prefix``, and its first token is sampled from the
same last-row logits with its own parameters and generator. The prompt's features are repeated for it, so
callers (the speculative worker's HiddenStates, observers) see every sequence as if prefilled itself. The
batch-invariant engines make this bit-identical to separate prefills; children admitted in different
steps (fewer free slots than n) each prefill.
"""

from __future__ import annotations

import time

import torch

from specdec.engine import ForwardBatch, ModelEngine
from specdec.engine.interface import current_stats
from specdec.interfaces import GroupStepOutput, StepOutput, Worker
from specdec.sampling.sampler import Sampler
from specdec.datamodel.hidden_states import ExecuteModelRequest
from specdec.datamodel.sequence import Logprob
from specdec.datamodel.metadata import SequenceGroupMetadata
from specdec.sampling.logprobs import position_logprobs
from specdec.sampling.guided import allowed_next, no_token_error
from specdec.sampling.logits_process import active_processor_fields
from specdec.sampling.sampler import argmax_last


class SlotTable:
    """seq_id -> KV slot for one engine, plus request_id -> seq_ids so a finished request frees all."""

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        self.slot_of: dict[int, int] = {}
        self.seqs_of: dict[str, list[int]] = {}

    def allocate(self, request_id: str, seq_id: int) -> int:
        if seq_id in self.slot_of:  # a re-prefill (recompute) reuses the slot from scratch
            slot = self.slot_of[seq_id]
            self.engine.rollback(slot, 0)
            return slot
        slot = self.engine.allocate_slot()
        self.slot_of[seq_id] = slot
        self.seqs_of.setdefault(request_id, []).append(seq_id)
        return slot

    def free(self, request_id: str) -> None:
        for seq_id in self.seqs_of.pop(request_id, []):
            self.engine.free_slot(self.slot_of.pop(seq_id))

    def release(self, request_id: str, seq_id: int) -> None:
        """Free one sequence's slot (the step that allocated it was rolled back)."""
        self.engine.free_slot(self.slot_of.pop(seq_id))
        seqs = self.seqs_of.get(request_id, [])
        if seq_id in seqs:
            seqs.remove(seq_id)
        if not seqs:
            self.seqs_of.pop(request_id, None)

    def snapshot(self, metas: list[SequenceGroupMetadata]) -> list[tuple[str, int, int | None]]:
        """(request id, seq id, KV length or None when it has no slot yet) of every sequence."""
        out = []
        for meta in metas:
            for seq_id in meta.seq_data:
                slot = self.slot_of.get(seq_id)
                out.append((meta.request_id, seq_id, None if slot is None else self.engine.seq_len(slot)))
        return out

    def restore(self, snapshot: list[tuple[str, int, int | None]]) -> None:
        """KV lengths back to the snapshot's; slots allocated since are freed. The KV below a length is
        never rewritten by a step (forwards append, rollbacks and compactions write past it), so this
        restores the cache exactly."""
        for request_id, seq_id, n in snapshot:
            slot = self.slot_of.get(seq_id)
            if slot is None:
                continue
            if n is None:
                self.release(request_id, seq_id)
                continue
            cur = self.engine.seq_len(slot)
            if cur < n:
                raise RuntimeError(f"SlotTable.restore: slot {slot} of sequence {seq_id} holds {cur} tokens, fewer "
                                   f"than the {n} it held before the step; {type(self.engine).__name__} broke the "
                                   "contract that a step only appends past a sequence's length")
            self.engine.rollback(slot, n)


def group_tokens(meta: SequenceGroupMetadata) -> tuple[int, list[int]]:
    """(seq_id, tokens to feed this step): the whole prompt on a prefill, else the last token."""
    seq_id, data = meta.first_seq()
    if meta.is_prompt:
        return seq_id, list(data.get_token_ids())
    return seq_id, [data.get_last_token_id()]


def prefill_sources(metas: list[SequenceGroupMetadata], fed: list[list[int]]) -> list[int]:
    """[B] per group, the group whose forward serves it: itself, or on a prefill the first earlier group
    fed the same tokens (see the module docstring)."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(toks), b) if meta.is_prompt else b
            for b, (meta, toks) in enumerate(zip(metas, fed))]


def logprob_dicts(out, logits: torch.Tensor,  # [B, V] raw logits the sampler saw
                  params: list) -> list[dict[int, Logprob]]:  # [B] SamplingParams
    """Per row: {emitted token: Logprob} from the SamplerOutput, or, for the requests that ask for
    ``logprobs`` / ``logprob_token_ids``, specdec.sampling.sampler.logprobs.position_logprobs of their logits rows (the
    speculative worker's definition too)."""
    toks = out.token_ids.tolist()
    dicts = [{t: Logprob(logprob=v)} for t, v in zip(toks, out.logprobs.tolist())]
    asked = [i for i, p in enumerate(params) if p.wants_logprobs]
    if asked:
        rows = logits[torch.tensor(asked, device=logits.device)]  # [A, V]
        for i, d in zip(asked, position_logprobs(rows, [toks[i] for i in asked], [params[i] for i in asked])):
            dicts[i] = d
    return dicts


class PlainWorker(Worker):
    def __init__(self, engine: ModelEngine, sampler: Sampler | None = None) -> None:
        self.engine = engine
        self.sampler = sampler or Sampler()
        self.slots = SlotTable(engine)
        # Read-only watchers of every step (e.g. specdec.experiment.trace): ``plain_step(metas, logits [B, V], features
        # [T, F], qlens, out)`` after each plain forward and, in a speculative worker, ``spec_step(metas,
        # proposals, scores, verdict, out)`` after each commit. They must not change what they are shown.
        self.observers: list = []
        self.hidden_layers: tuple[int, ...] = ()  # layers whose outputs plain forwards return (observers')

    def num_free_slots(self) -> int:
        return self.engine.num_free_slots()

    def free_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.slots.free(rid)

    def snapshot(self, seq_group_metadata_list: list[SequenceGroupMetadata]):
        return self.slots.snapshot(seq_group_metadata_list)

    def restore(self, snapshot) -> None:
        self.slots.restore(snapshot)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> StepOutput:
        self.free_requests(execute_model_req.finished_requests_ids)
        return self.forward_and_sample(execute_model_req.seq_group_metadata_list)[0]

    def release(self) -> None:
        """The step loop is idle: hand back what the engine holds between steps (its decode-mode threads)."""
        self.engine.release_threads()

    def decode_steps(self, metas: list[SequenceGroupMetadata], num_steps: int,
                     limits: list[tuple[int, frozenset[int]] | None],  # [B] (budget, stop ids): multi_step.row_limits
                     ) -> tuple[list[list[GroupStepOutput]], dict[str, float]] | None:
        """Up to ``num_steps`` decode steps with no Python object per row per step (multi-step decoding,
        specdec/core/multi_step.py): each step's sampled tokens [R] are the next forward's input, a row leaves
        the batch once it emitted ``budget`` tokens, one of its stop ids or a non-finite row, and the outputs
        are built once at the end. Returns ([B] each group's outputs, one per step it ran; phase times), or
        None where this loop does not apply (a prefill, logits processors, guided decoding, logprobs asked,
        observers or hidden layers to hand out): the caller then runs ``execute_model`` per step.
        Greedy rows take the engine's LogitStats argmax (torch.argmax's, like the Sampler's); the others go
        through the Sampler with their generators, as forward_and_sample does."""
        if type(self).execute_model is not PlainWorker.execute_model:  # a subclass that changes a step keeps it
            return None
        if (self.observers or self.hidden_layers or any(lim is None for lim in limits)
                or any(m.is_prompt or (m.state is not None and m.state.grammar is not None)
                       or m.sampling_params.wants_logprobs or active_processor_fields(m.sampling_params)
                       for m in metas)):
            return None
        B = len(metas)
        dev = self.engine.device
        params = [m.sampling_params for m in metas]
        gens = [m.state.generator if m.state is not None else None for m in metas]
        slots = [self.slots.slot_of[m.get_first_seq_id()] for m in metas]
        budget = [lim[0] for lim in limits]
        stops = [lim[1] for lim in limits]
        live = [b for b in range(B) if budget[b] > 0]
        tok = torch.tensor([m.first_seq_data().get_last_token_id() for m in metas], dtype=torch.long)[live]  # [R]
        steps: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, tok, logprob, finite)
        t_fwd = 0.0
        for _ in range(num_steps):
            if not live:
                break
            R = len(live)
            t0 = time.perf_counter()
            out = self.engine.forward(ForwardBatch(token_ids=tok.to(dev), slots=[slots[b] for b in live],
                                                   query_lens=[1] * R, logit_stats=True))  # logits [R, V]
            t_fwd += time.perf_counter() - t0
            logits, stats = out.logits, current_stats(out.logit_stats, out.logits)
            if all(params[b].temperature == 0.0 for b in live):
                if stats is None:
                    lse, finite = torch.logsumexp(logits.float(), -1), torch.isfinite(logits.sum(-1))
                    tok = argmax_last(logits.float())
                else:
                    tok, lse, finite = stats.argmax.to(torch.long), stats.lse, stats.finite
                if not bool(finite.all()):  # a non-finite row's argmax is unset: any index, it ends with an error
                    tok = torch.where(finite.to(tok.device), tok, 0)
                logprob = logits.gather(-1, tok[:, None].to(logits.device)).squeeze(-1).float().cpu() - lse.cpu()
            else:
                sampled = self.sampler(logits, [params[b] for b in live], [gens[b] for b in live])
                tok, logprob, finite = sampled.token_ids, sampled.logprobs, sampled.finite
            tok, finite = tok.cpu(), finite.cpu()
            steps.append((live, tok, logprob, finite))
            toks, fins = tok.tolist(), finite.tolist()
            keep = []
            for r, b in enumerate(live):
                budget[b] -= 1
                if fins[r] and budget[b] > 0 and toks[r] not in stops[b]:
                    keep.append(r)
            if len(keep) < R:
                live = [live[r] for r in keep]
                tok = tok[torch.tensor(keep, dtype=torch.long)]
        # pythonize once: every step's rows into GroupStepOutputs
        per: list[list[GroupStepOutput]] = [[] for _ in range(B)]
        for rows, t, lp, fin in steps:
            for b, ti, li, fi in zip(rows, t.tolist(), lp.tolist(), fin.tolist()):
                per[b].append(GroupStepOutput([ti], [{ti: Logprob(logprob=li)}]) if fi
                              else GroupStepOutput([], error=nan_error(metas[b].request_id)))
        return per, {"forward": t_fwd}

    def forward_and_sample(self, metas: list[SequenceGroupMetadata], hidden_layers: tuple[int, ...] | None = None,
                           ) -> tuple[StepOutput, torch.Tensor, list[int]]:
        """One target forward (prefill or 1-token decode per group) and one sample per group.
        Returns the step output, the features of every fed token ([T, F]: ``hidden_layers``' outputs, or
        the last layer after the final norm; see ForwardOutput.features) and the tokens fed per group [B].
        ``hidden_layers`` None = this worker's own ``hidden_layers``."""
        hidden_layers = self.hidden_layers if hidden_layers is None else hidden_layers
        slots: list[int] = []
        fed: list[list[int]] = []
        for meta in metas:
            seq_id, toks = group_tokens(meta)
            slots.append(self.slots.allocate(meta.request_id, seq_id) if meta.is_prompt else self.slots.slot_of[seq_id])
            fed.append(toks)
        qlens = [len(t) for t in fed]
        src = prefill_sources(metas, fed)  # [B]
        run = [b for b in range(len(metas)) if src[b] == b]  # the groups actually fed
        run_lens = [qlens[b] for b in run]
        last_rows = (torch.tensor(run_lens).cumsum(0) - 1).to(self.engine.device)  # [R] each fed group's last row
        t_fwd = time.perf_counter()
        out = self.engine.forward(ForwardBatch(
            token_ids=torch.tensor([t for b in run for t in fed[b]], dtype=torch.long, device=self.engine.device),
            slots=[slots[b] for b in run], query_lens=run_lens, logits_indices=last_rows, hidden_layers=hidden_layers,
            logit_stats=True,  # the sampler's argmax, logsumexp and finiteness, taken as the rows are written
        ))  # logits [R, V], features [sum(run_lens), F]
        t_fwd = time.perf_counter() - t_fwd
        logits, features = out.logits, out.features
        if len(run) < len(metas):  # shared prefills: copy the KV, repeat the logits row and the feature rows
            at = {b: i for i, b in enumerate(run)}
            starts = [0, *torch.tensor(run_lens).cumsum(0).tolist()]
            for b, s in enumerate(src):
                if s != b:
                    self.engine.copy_prefix(slots[s], slots[b], qlens[b])
            logits = logits[torch.tensor([at[s] for s in src], device=logits.device)]  # [B, V]
            rows = torch.cat([torch.arange(starts[at[s]], starts[at[s]] + qlens[b]) for b, s in enumerate(src)])
            features = features[rows.to(features.device)]  # [sum(qlens), F]
        params = [m.sampling_params for m in metas]
        gens = [m.state.generator if m.state is not None else None for m in metas]
        data = [m.first_seq_data() for m in metas]
        grammars = [m.state.grammar if m.state is not None else None for m in metas]
        allowed = allowed_next(grammars, data, logits.shape[-1])  # [B, V] guided_decoding's masks, or None
        sampled = self.sampler(logits, params, gens, seq_data=data, allowed=allowed,
                               stats=current_stats(out.logit_stats, logits))
        lps = logprob_dicts(sampled, logits, params)
        token_list = sampled.token_ids.tolist()
        finite = sampled.finite.tolist()
        no_token = [False] * len(metas) if sampled.no_token is None else sampled.no_token.tolist()
        results = []
        for i, meta in enumerate(metas):
            if not finite[i]:
                results.append(GroupStepOutput([], error=nan_error(meta.request_id)))
            elif no_token[i]:  # its grammar (with its other processors) allows nothing: it ends, alone
                results.append(GroupStepOutput([], error=no_token_error(meta.request_id, grammars[i],
                                                                        not bool(allowed[i].any()))))
            else:
                results.append(GroupStepOutput([token_list[i]], [lps[i]]))
        step = StepOutput(results, times={"forward": t_fwd})
        for obs in self.observers:
            obs.plain_step(metas, logits, features, qlens, step)
        return step, features, qlens


def nan_error(request_id: str) -> str:
    return (f"request {request_id}: the target's logits contain NaN or inf; the request was stopped "
            "(check the model weights/dtype, e.g. use dtype='float32')")
