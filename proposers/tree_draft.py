"""TreeDraftProposer: EAGLE-2's dynamic draft tree over any draft engine; and the tree builder itself.

:func:`build_dynamic_tree` is EAGLE-2's expansion (Li et al. 2024, sec. 4), batched over sequences:
depth 1 takes the top-k tokens after the pending token; at each further depth the k frontier nodes are
expanded (their draft log-probs come from ``expand``), each frontier node's top-k children become
candidates scored by *cumulative* draft log-prob, and the best k of those form the next frontier. The
tree is then reranked: the ``budget`` best candidates of all depths are kept. A child's score is its
parent's plus a log-prob <= 0, and a stable sort keeps the earlier-made parent first on ties, so the kept
set always contains every kept node's ancestors. The tree is a deterministic function of the draft's
logits: verification treats every node as a one-hot draft, which stays lossless although nodes were
selected by their own scores (see specdec/tree.py).

:class:`TreeDraftProposer` feeds the draft model for ``expand``. The engine's tree mask covers new tokens
only (the cached prefix is always visible), so each expansion rolls the draft slot back to the
committed tokens and re-feeds every frontier node so far (depths 1..d-1, ancestor mask, depth positions),
computing logits for the newest frontier only: (depth-1) forwards of k, 2k, ... tokens. After the last
one the slot holds those nodes' KV; :meth:`TreeDraftProposer.accepted` compacts the accepted ones
into place, and the next step's catch-up feeds the rest of the accepted path (as DraftModelProposer).

An EAGLE head plugs into :func:`build_dynamic_tree` with its own ``expand`` (the head run on each
frontier node's parent feature + token embedding).
Knows nothing about the target or verification.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import get_ops
from proposers.draft_model import DraftModelProposer
from specdec.engine import ForwardBatch
from specdec.spec_decode.proposer import ProposeBatch
from specdec.tree import TreeProposals, TreeProposer, TreeShape

__all__ = ["CandidateTree", "TreeDraftProposer", "build_dynamic_tree", "frontier_subtree"]


@dataclass
class CandidateTree:
    """Every node drafted so far, in creation order (depth-major), C of them in every row."""

    token_ids: torch.Tensor  # [B, C] int64
    parents: torch.Tensor  # [B, C] int64 candidate index of the parent, -1 = child of the pending token
    scores: torch.Tensor  # [B, C] float32 cumulative draft log-prob of the path to the node
    depths: torch.Tensor  # [C] int64, 1 = child of the pending token


# (candidates so far, frontiers: [B, k] candidate ids at depths 1..d-1, the last one to expand)
#   -> [B, k, V] draft log-probs of the token after each node of the last frontier
ExpandFn = Callable[[CandidateTree, list[torch.Tensor]], torch.Tensor]


def build_dynamic_tree(root_logprobs: torch.Tensor,  # [B, V] draft log-probs after the pending token
                       expand: ExpandFn, shape: TreeShape,
                       ) -> tuple[TreeProposals, torch.Tensor]:  # tree [B, N], candidate id per node [B, N]
    B, V = root_logprobs.shape
    dev = root_logprobs.device
    k = min(shape.topk, V)
    scores, tokens = root_logprobs.float().topk(k, dim=-1)  # [B, k]
    toks, pars, scs, deps = [tokens], [torch.full((B, k), -1, dtype=torch.long, device=dev)], [scores], [1] * k
    frontier = torch.arange(k, device=dev).expand(B, k)
    frontiers = [frontier]
    for d in range(2, shape.depth + 1):
        cands = CandidateTree(torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(scs, 1), torch.tensor(deps, device=dev))
        lp = expand(cands, frontiers)  # [B, k, V]
        child_lp, child_tok = lp.float().topk(k, dim=-1)  # [B, k, k]
        child_sc = (cands.scores.gather(1, frontier)[:, :, None] + child_lp).reshape(B, k * k)
        C = cands.token_ids.shape[1]
        toks.append(child_tok.reshape(B, k * k))
        pars.append(frontier[:, :, None].expand(B, k, k).reshape(B, k * k))
        scs.append(child_sc)
        deps += [d] * (k * k)
        frontier = C + child_sc.topk(k, dim=1).indices.sort(1).values  # [B, k] best k of this depth
        frontiers.append(frontier)
    cand_tok, cand_par, cand_sc = torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(scs, 1)
    C = cand_tok.shape[1]
    N = min(shape.budget, C)
    # stable: among equal scores the earlier candidate (a parent before its children) wins
    keep = torch.sort(cand_sc, dim=1, descending=True, stable=True).indices[:, :N].sort(1).values  # [B, N]
    pos = torch.full((B, C), -1, dtype=torch.long, device=dev)
    pos.scatter_(1, keep, torch.arange(N, device=dev).expand(B, N))
    par_c = cand_par.gather(1, keep)
    parents = torch.where(par_c >= 0, pos.gather(1, par_c.clamp(min=0)), torch.full_like(par_c, -1))
    if bool(((par_c >= 0) & (parents < 0)).any()):  # cannot happen with log-probs <= 0; NaN logits would
        raise RuntimeError("build_dynamic_tree: a kept node's parent was pruned (NaN draft log-probs?)")
    tree = TreeProposals(token_ids=cand_tok.gather(1, keep), parents=parents,
                         num_nodes=torch.full((B,), N, dtype=torch.long, device=dev))
    return tree, keep


def frontier_subtree(cands: CandidateTree, frontiers: list[torch.Tensor],
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expanded nodes so far as their own tree, depth-major (the last k are the newest frontier):
    candidate ids [B, F], root-inclusive parents [B, F+1] (node 0 = pending token), depths [B, F]."""
    fed = torch.cat(frontiers, 1)  # [B, F]
    B, F = fed.shape
    pos = torch.full_like(cands.parents, -1)
    pos.scatter_(1, fed, torch.arange(F, device=fed.device).expand(B, F))
    par_c = cands.parents.gather(1, fed)  # a frontier node's parent is in the previous frontier
    par = torch.where(par_c >= 0, pos.gather(1, par_c.clamp(min=0)), torch.full_like(par_c, -1))
    root = torch.full((B, 1), -1, dtype=torch.long, device=fed.device)
    return fed, torch.cat([root, par + 1], 1), cands.depths[fed]


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
