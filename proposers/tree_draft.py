"""TreeDraftProposer: EAGLE-2's dynamic draft tree (proposers/dynamic_tree.py) over any draft engine.

The engine's tree mask covers new tokens only (the cached prefix is always visible), so each expansion
rolls the draft slot back to the committed tokens and re-feeds every frontier node so far (depths
1..d-1, ancestor mask, depth positions), computing logits for the newest frontier only: (depth-1)
forwards of k, 2k, ... tokens. After the last one the slot holds those nodes' KV;
:meth:`TreeDraftProposer.accepted` compacts the accepted ones into place, and the next step's catch-up
feeds the rest of the accepted path (as DraftModelProposer).
Knows nothing about the target or verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_kernels import get_ops
from proposers.draft_model import DraftModelProposer
from proposers.dynamic_tree import CandidateTree, build_dynamic_tree, frontier_subtree
from specdec.engine import ForwardBatch
from specdec.spec_decode.proposer import ProposeBatch
from specdec.spec_decode.proposer import TreeProposals, TreeProposer, TreeShape

__all__ = ["TreeDraftProposer"]


@dataclass
class _Drafted:
    """What one tree step left in a sequence's draft slot, for accepted()."""

    base_len: int  # committed tokens (pending included) = draft slot length before the tree nodes
    node_cand: list[int]  # [N] candidate id of each tree node
    node_tokens: list[int]  # [N]
    fed_pos: dict[int, int]  # candidate id -> offset of its KV after base_len in the draft slot


class TreeDraftProposer(DraftModelProposer, TreeProposer):
    """A draft model (``model`` / ``options.engine``, as DraftModelProposer) drafting EAGLE-2 trees; its
    chain ``propose`` is DraftModelProposer's."""

    def __init__(self, target, config) -> None:
        super().__init__(target, config)
        self._ops = get_ops(config.kernel)
        self._drafted: dict[int, _Drafted] = {}

    def tree_lookahead(self, shape: TreeShape) -> int:
        return max(shape.budget, (shape.depth - 1) * shape.topk)  # the last re-feed holds (depth-1)*k nodes

    def _sync(self, seq_id: int, tokens: list[int]) -> list[int]:
        # After a tree step the slot may hold tree nodes past the tokens it is known to hold
        # (accepted() not called): drop them before the lazy catch-up appends.
        self._drafted.pop(seq_id, None)
        slot, held = self.slot_of.get(seq_id), self._held.get(seq_id)
        if slot is not None and self.engine.seq_len(slot) > len(held):
            self.engine.rollback(slot, len(held))
        return super()._sync(seq_id, tokens)

    def free(self, seq_id: int) -> None:
        self._drafted.pop(seq_id, None)
        super().free(seq_id)

    def snapshot(self, seq_ids: list[int]):
        return super().snapshot(seq_ids), {s: self._drafted.get(s) for s in seq_ids}

    def restore(self, seq_ids: list[int], snapshot) -> None:
        held, drafted = snapshot
        super().restore(seq_ids, held)
        for s, d in drafted.items():
            if d is None:
                self._drafted.pop(s, None)
            else:
                self._drafted[s] = d

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        eng, dev = self.engine, self.engine.device
        feeds = [self._sync(s, toks) for s, toks in zip(batch.seq_ids, batch.token_ids)]
        slots = [self.slot_of[s] for s in batch.seq_ids]
        qlens = [len(f) for f in feeds]
        logits = eng.forward(ForwardBatch(
            token_ids=torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=dev), slots=slots,
            query_lens=qlens, logits_indices=torch.tensor(qlens, device=dev).cumsum(0) - 1,
        )).logits  # [B, V] after each pending token
        for f, s in zip(feeds, batch.seq_ids):
            self._held[s].extend(f)
        base = [len(t) for t in batch.token_ids]
        base_t = torch.tensor(base, device=dev)
        B = len(slots)
        fed_last: list[torch.Tensor] = []

        def expand(cands: CandidateTree, frontiers: list[torch.Tensor]) -> torch.Tensor:
            fed, parents, depths = frontier_subtree(cands, frontiers)  # [B, F], [B, F+1], [B, F]
            F, k = fed.shape[1], frontiers[-1].shape[1]
            mask = self._ops.build_tree_mask(parents)[:, 1:, 1:]  # [B, F, F]: ancestors among the fed nodes
            for slot, n in zip(slots, base):
                eng.rollback(slot, n)
            newest = (torch.arange(B, device=dev)[:, None] * F + torch.arange(F - k, F, device=dev)).reshape(-1)
            lg = eng.forward(ForwardBatch(
                token_ids=cands.token_ids.gather(1, fed).reshape(-1), slots=slots, query_lens=[F] * B,
                positions=(base_t[:, None] - 1 + depths).reshape(-1), tree_mask=mask.reshape(B * F, F),
                logits_indices=newest,
            )).logits  # [B * k, V]
            fed_last[:] = [fed]
            return torch.log_softmax(lg.float(), -1).view(B, k, -1)

        tree, keep = build_dynamic_tree(torch.log_softmax(logits.float(), -1), expand, shape)
        fed_rows = fed_last[0].tolist() if fed_last else [[] for _ in range(B)]
        for b, s in enumerate(batch.seq_ids):
            self._drafted[s] = _Drafted(base[b], keep[b].tolist(), tree.token_ids[b].tolist(),
                                        {c: i for i, c in enumerate(fed_rows[b])})
        return tree

    def accepted(self, seq_id: int, base_len: int, nodes: list[int]) -> None:
        accepted_nodes = nodes
        st = self._drafted.pop(seq_id, None)
        if st is None or st.base_len != base_len:  # not drafted by the last tree step: a chain's rollback
            super().accepted(seq_id, base_len, nodes)
            return
        # the accepted path's expanded nodes are a prefix of it (a node is expanded only if its parent was)
        src: list[int] = []
        for i in accepted_nodes:
            off = st.fed_pos.get(st.node_cand[i])
            if off is None:
                break
            src.append(base_len + off)
        self.engine.compact(self.slot_of[seq_id], torch.tensor(src, dtype=torch.long), base_len)
        held = self._held[seq_id]
        del held[base_len:]
        held.extend(st.node_tokens[i] for i in accepted_nodes[: len(src)])
