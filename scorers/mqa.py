"""MQA scorer: one target forward of [pending token, drafts...] per sequence, all sequences in one batch.

Knows nothing about how proposals were made or how they are verified.
"""

from __future__ import annotations

import torch

from specdec.engine import ForwardBatch, ModelEngine
from specdec.engine.interface import LogitStats, current_stats
from specdec.interfaces import SpeculativeProposals, SpeculativeScorer, SpeculativeScores
from specdec.datamodel.hidden_states import ExecuteModelRequest


def pending_tokens(req: ExecuteModelRequest) -> tuple[list[int], list[int]]:
    """(seq_ids [B], last token of each sequence [B]): the token the target has not seen yet."""
    seq_ids, last = [], []
    for meta in req.seq_group_metadata_list:
        seq_id, data = meta.first_seq()
        seq_ids.append(seq_id)
        last.append(data.get_last_token_id())
    return seq_ids, last


def pad_index(qlens: list[int], width: int) -> torch.Tensor:
    """[B * width] int64: the row of the flat layout each padded row takes (a short sequence repeats its last)."""
    idx, start = [], 0
    for q in qlens:
        idx += [start + min(j, q - 1) for j in range(width)]
        start += q
    return torch.tensor(idx)


def pad_rows(flat: torch.Tensor, qlens: list[int], width: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """[T, ...] rows laid out sequence after sequence -> [B, width, ...]; missing rows repeat the last.
    Every sequence full (T = B * width, the usual chain or fixed-budget tree): a view, no copy of the logits.
    Otherwise wide rows (logits) are copied sequence by sequence as blocks, each last row broadcast into the rest;
    narrow ones gathered through ``index`` (``pad_index``, built once per step for all of a step's tensors).
    Measured 2026-12-05: [13, 49152] logits into [1, 14] 260 -> 54 us; 16 ragged sequences 1,551 -> 960 us."""
    B = len(qlens)
    if all(q == width for q in qlens) and flat.shape[0] == B * width:
        return flat.view(B, width, *flat.shape[1:])
    if flat[0].numel() < 4096:
        index = pad_index(qlens, width) if index is None else index
        return flat.index_select(0, index).view(B, width, *flat.shape[1:])
    out = flat.new_empty(B, width, *flat.shape[1:])
    start = 0
    for b, q in enumerate(qlens):
        out[b, :q] = flat[start : start + q]
        if q < width:
            out[b, q:] = flat[start + q - 1]
        start += q
    return out


class MQAScorer(SpeculativeScorer):
    def __init__(self, target: ModelEngine, slot_of: dict[int, int], kernel: str = "torch",
                 hidden_layers: tuple[int, ...] = ()) -> None:
        self.target = target
        self.slot_of = slot_of  # seq_id -> target KV slot (owned by the worker)
        self.hidden_layers = hidden_layers  # target layers whose outputs the proposer reads (FeatureSpec)

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        if not proposals.is_chain:
            raise ValueError(f"{type(self).__name__} scores chains; these proposals branch: use scorer='tree'")
        seq_ids, last = pending_tokens(execute_model_req)
        k = proposals.token_ids.shape[1]
        lens = proposals.num_nodes.tolist()
        drafts = proposals.token_ids.tolist()
        tokens: list[int] = []
        qlens: list[int] = []
        for b in range(len(seq_ids)):
            tokens.append(last[b])
            tokens.extend(drafts[b][: lens[b]])
            qlens.append(lens[b] + 1)
        out = self.target.forward(ForwardBatch(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=self.target.device),
            slots=[self.slot_of[s] for s in seq_ids],
            query_lens=qlens, hidden_layers=self.hidden_layers, logit_stats=True,
        ))
        return scores_from_rows(out.logits, out.features, qlens, k + 1, current_stats(out.logit_stats, out.logits))


def scores_from_rows(logits: torch.Tensor, hidden: torch.Tensor, qlens: list[int], width: int,
                     stats: LogitStats | None = None) -> SpeculativeScores:
    """logits [T, V], features [T, F] (sequence after sequence), and the engine's facts of the logits' rows when it
    took them (``LogitStats``) -> SpeculativeScores padded to [B, width]."""
    padded = pad_rows(logits.float(), qlens, width)
    full = all(q == width for q in qlens)
    index = None if full else pad_index(qlens, width)  # shared by the narrow tensors below
    return SpeculativeScores(logits=padded, hidden_states=pad_rows(hidden, qlens, width, index),
                             logit_stats=None if stats is None else stats.map(lambda t: pad_rows(t, qlens, width, index),
                                                                             padded))
