"""Batch-expansion scorer (vLLM v0 ``BatchExpansionTop1Scorer`` semantics) on the slot KV engine.

Expansion: a sequence with a proposal of length p becomes p+1 virtual sequences, j = 0..p: its tokens
plus the first j drafts, each scored as one single-token decode query (its last token) under a fresh
target seq id (vLLM's ``_create_target_seq_id_iterator``: counting up from max(seq ids) + 1). A sequence
with p = 0 stays one plain decode query under its own id. Contraction maps every virtual query's row back
to (sequence, j) and pads to [B, k+1] exactly as :class:`scorers.mqa.MQAScorer` returns (rows past p
repeat row p).

How the expansion maps onto the slot KV cache, honestly: virtual sequence j's context is the real
sequence's cached prefix plus t_0..t_{j-1} (t_0 = the pending token, t_j = draft j), and the only KV of
those not already in the slot is the KV that virtual queries 0..j-1 write. So the p+1 queries of one
sequence run in ONE engine forward on the sequence's own slot, each writing its KV at cache index
``old_len + j`` (= its virtual sequence's last position) and attending causally to the prefix and the
earlier virtual tokens. That is also what vLLM v0 computes (the expanded sequences share the original's
block table plus lookahead slots); here the forward is literally the same as MQA's, and what differs is
the bookkeeping: explicit virtual sequences, target seq ids, and the position of each query taken from
its virtual sequence's length (checked against the slot). The slot is left holding old_len + p + 1
tokens, as after MQA; the worker rolls it back after verification.

Knows nothing about how proposals were made or how they are verified.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from scorers.mqa import scores_from_rows
from specdec.engine import ForwardBatch, ModelEngine
from specdec.interfaces import SpeculativeProposals, SpeculativeScorer, SpeculativeScores
from specdec.datamodel.hidden_states import ExecuteModelRequest


@dataclass
class VirtualSeq:
    """One expanded single-token query: the parent sequence's tokens plus its first j drafts."""

    target_seq_id: int  # fresh id for j-expanded sequences; the parent's own id for a p = 0 sequence
    parent: int  # index b of the parent sequence in the batch
    j: int  # drafts appended to the parent's tokens: 0..p
    token_id: int  # the query token: the pending token (j = 0) or draft j (j >= 1)
    position: int  # its position = len(parent tokens) - 1 + j


def create_target_seq_id_iterator(seq_ids: list[int]):
    """Fresh target seq ids that cannot collide with the batch's: max(seq_ids) + 1, + 2, ..."""
    return itertools.count(max(seq_ids, default=-1) + 1)


class BatchExpansionScorer(SpeculativeScorer):
    def __init__(self, target: ModelEngine, slot_of: dict[int, int], kernel: str = "torch",
                 hidden_layers: tuple[int, ...] = ()) -> None:
        self.target = target
        self.slot_of = slot_of  # seq_id -> target KV slot (owned by the worker)
        self.hidden_layers = hidden_layers  # target layers whose outputs the proposer reads (FeatureSpec)

    def expand(self, req: ExecuteModelRequest, proposals: SpeculativeProposals) -> tuple[list[int], list[VirtualSeq]]:
        """(parent seq ids [B], virtual sequences ordered parent after parent, j ascending)."""
        if not proposals.is_chain:
            raise ValueError(f"{type(self).__name__} scores chains; these proposals branch: use scorer='tree'")
        lens = proposals.num_nodes.tolist()
        drafts = proposals.token_ids.tolist()
        seq_ids, datas = [], []
        for meta in req.seq_group_metadata_list:
            seq_id, data = meta.first_seq()
            seq_ids.append(seq_id)
            datas.append(data)
        new_ids = create_target_seq_id_iterator(seq_ids)
        virtual: list[VirtualSeq] = []
        for b, (seq_id, data) in enumerate(zip(seq_ids, datas)):
            p, n = lens[b], data.get_len()
            query_tokens = [data.get_last_token_id(), *drafts[b][:p]]  # t_0 .. t_p
            for j, tok in enumerate(query_tokens):
                tid = seq_id if p == 0 else next(new_ids)
                virtual.append(VirtualSeq(target_seq_id=tid, parent=b, j=j, token_id=tok, position=n - 1 + j))
        return seq_ids, virtual

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        seq_ids, virtual = self.expand(execute_model_req, proposals)
        k = proposals.token_ids.shape[1]
        qlens = [0] * len(seq_ids)
        for v in virtual:
            qlens[v.parent] += 1
        slots = [self.slot_of[s] for s in seq_ids]
        start = 0
        for b, slot in enumerate(slots):  # virtual query j=0 sits right after the slot's cached tokens
            if self.target.seq_len(slot) != virtual[start].position:
                raise ValueError(f"BatchExpansionScorer: seq {seq_ids[b]}'s target slot {slot} holds "
                                 f"{self.target.seq_len(slot)} tokens, expected {virtual[start].position} "
                                 "(every token but the pending one)")
            start += qlens[b]
        dev = self.target.device
        out = self.target.forward(ForwardBatch(
            token_ids=torch.tensor([v.token_id for v in virtual], dtype=torch.long, device=dev),
            slots=slots,
            query_lens=qlens,  # one sequence's virtual queries share its slot, causal among themselves
            positions=torch.tensor([v.position for v in virtual], dtype=torch.long, device=dev),
            hidden_layers=self.hidden_layers,
        ))
        return self.contract(out.logits, out.features, virtual, len(seq_ids), k + 1)

    @staticmethod
    def contract(logits: torch.Tensor, hidden: torch.Tensor, virtual: list[VirtualSeq], B: int,
                 width: int) -> SpeculativeScores:
        """Rows of the virtual queries (logits [T, V], hidden [T, D]) -> SpeculativeScores [B, width, ...].
        (b, j) takes virtual query (b, min(j, p_b)): positions past a proposal repeat its last row."""
        row_of = {(v.parent, v.j): r for r, v in enumerate(virtual)}
        last = [0] * B
        for v in virtual:
            last[v.parent] = max(last[v.parent], v.j)
        idx = torch.tensor([row_of[b, min(j, last[b])] for b in range(B) for j in range(width)],
                           device=logits.device)  # [B * width]
        # rows now laid out (b, j) with width rows each: the same padded layout MQAScorer returns
        return scores_from_rows(logits[idx], hidden[idx], [width] * B, width)
