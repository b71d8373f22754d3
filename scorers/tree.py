"""Tree scorer: one target forward over [pending token, tree nodes...] per sequence, all sequences batched.

The nodes take consecutive cache slots after the pending token (node i of the root-inclusive layout at
cache index ``base_len - 1 + i``), but each one's RoPE position is its depth (``base_len - 1 + depth``)
and it attends to the cached prefix plus its own ancestors only (``specdec_kernels.get_ops(kernel).build_tree_mask``),
so its logits and KV are those of the sequence "prefix + the path to it". The worker later compacts the
accepted path's KV into place (``ModelEngine.compact``).

Knows nothing about how the tree was proposed or how it is verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_kernels import get_ops
from scorers.mqa import scores_from_rows
from specdec.engine import ForwardBatch, ModelEngine
from specdec.engine.interface import current_stats
from specdec.interfaces import SpeculativeProposals, SpeculativeScorer, SpeculativeScores
from specdec.datamodel.hidden_states import ExecuteModelRequest


@dataclass
class TreeBatch:
    """The flat ForwardBatch fields of a tree step (sequence after sequence, T = sum(query_lens))."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: base_len - 1 + depth
    tree_mask: torch.Tensor  # [T, max(query_lens)] bool: ancestor-or-self among the sequence's new tokens
    query_lens: list[int]  # [B] num_nodes + 1


def tree_batch(parents: torch.Tensor,  # [B, M] int64 root-inclusive parent arrays
               token_ids: torch.Tensor,  # [B, M] int64 root-inclusive (node 0 = pending token)
               num_nodes: torch.Tensor,  # [B] int64 real draft nodes per row
               base_lens: torch.Tensor,  # [B] int64 tokens per sequence, pending one included
               kernel: str = "torch") -> TreeBatch:
    if kernel == "torch" and parents.device.type == "cpu" and parents.numel() <= 4096:
        return _tree_batch_lists(parents.tolist(), token_ids.tolist(), num_nodes.tolist(), base_lens.tolist())
    return _tree_batch_tensors(parents, token_ids, num_nodes, base_lens, kernel)


def _tree_batch_tensors(parents: torch.Tensor, token_ids: torch.Tensor, num_nodes: torch.Tensor,
                        base_lens: torch.Tensor, kernel: str) -> TreeBatch:
    """tree_batch through the kernels' build_tree_mask (any device, any size)."""
    B, M = parents.shape
    mask = get_ops(kernel).build_tree_mask(parents)  # [B, M, M]
    depth = mask.sum(-1) - 1  # [B, M] ancestors = depth
    qlens = (num_nodes + 1).tolist()
    real = torch.arange(M, device=parents.device)[None, :] < (num_nodes + 1).to(parents.device)[:, None]
    positions = base_lens.to(parents.device)[:, None] - 1 + depth  # [B, M]
    return TreeBatch(token_ids=token_ids[real], positions=positions[real],
                     tree_mask=mask[:, :, : max(qlens)][real], query_lens=qlens)


def _tree_batch_lists(parents: list[list[int]], token_ids: list[list[int]], num_nodes: list[int],
                      base_lens: list[int]) -> TreeBatch:
    """tree_batch of a step's few nodes from lists, each node's mask row its parent's plus itself (parents come
    before their children: SpeculativeProposals checks it). The same TreeBatch as the tensor path; ~15 tensor ops
    fewer, which matter here: a step's Python runs with caches cold from the forward."""
    qlens = [n + 1 for n in num_nodes]
    mask = np.zeros((sum(qlens), max(qlens)), dtype=bool)  # [T, max(query_lens)]
    toks, pos, r = [], [], 0
    for par, tok, q, base in zip(parents, token_ids, qlens, base_lens):
        depth = [0] * q
        for i in range(q):
            p = par[i]
            if p >= 0:
                mask[r + i] = mask[r + p]
                depth[i] = depth[p] + 1
            mask[r + i, i] = True
            pos.append(base - 1 + depth[i])
        toks += tok[:q]
        r += q
    return TreeBatch(token_ids=torch.tensor(toks, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
                     tree_mask=torch.from_numpy(mask), query_lens=qlens)


class TreeScorer(SpeculativeScorer):
    """The tree analogue of MQAScorer: proposals may branch (a chain is scored as a one-branch tree)."""

    drafts_trees = True

    def __init__(self, target: ModelEngine, slot_of: dict[int, int], kernel: str = "torch",
                 hidden_layers: tuple[int, ...] = ()) -> None:
        self.target = target
        self.slot_of = slot_of  # seq_id -> target KV slot (owned by the worker)
        self.kernel = kernel
        self.hidden_layers = hidden_layers  # target layers whose outputs the proposer reads (FeatureSpec)

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        seq_ids, last, lens = [], [], []
        for meta in execute_model_req.seq_group_metadata_list:
            seq_id, data = meta.first_seq()
            seq_ids.append(seq_id)
            last.append(data.get_last_token_id())
            lens.append(data.get_len())
        slots = [self.slot_of[s] for s in seq_ids]
        for s, slot, n in zip(seq_ids, slots, lens):
            if self.target.seq_len(slot) != n - 1:
                raise ValueError(f"TreeScorer: seq {s}'s target slot {slot} holds {self.target.seq_len(slot)} "
                                 f"tokens, expected {n - 1} (every token but the pending one)")
        parents, tokens = proposals.with_root(torch.tensor(last))
        tb = tree_batch(parents, tokens, proposals.num_nodes, torch.tensor(lens), self.kernel)
        dev = self.target.device
        out = self.target.forward(ForwardBatch(
            token_ids=tb.token_ids.to(dev), slots=slots, query_lens=tb.query_lens,
            positions=tb.positions.to(dev), tree_mask=tb.tree_mask.to(dev), hidden_layers=self.hidden_layers,
            logit_stats=True,
        ))
        return scores_from_rows(out.logits, out.features, tb.query_lens, parents.shape[1],
                                current_stats(out.logit_stats, out.logits))
