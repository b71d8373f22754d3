"""EAGLE-2's dynamic draft tree, shared by every tree-drafting proposer that ranks nodes by draft log-prob.

TreeDraftProposer: EAGLE-2's dynamic draft tree over any draft engine; and the tree builder itself.

:func:`build_dynamic_tree` is EAGLE-2's expansion (Li et al. 2024, sec. 4), batched over sequences:
depth 1 takes the top-k tokens after the pending token; at each further depth the k frontier nodes are
expanded (their draft log-probs come from ``expand``), each frontier node's top-k children become
candidates scored by *cumulative* draft log-prob, and the best k of those form the next frontier. The
tree is then reranked: the ``budget`` best candidates of all depths are kept. A child's score is its
parent's plus a log-prob <= 0, and a stable sort keeps the earlier-made parent first on ties, so the kept
set always contains every kept node's ancestors. The tree is a deterministic function of the draft's
logits: verification treats every node as a one-hot draft, which stays lossless although nodes were
selected by their own scores (see specdec/verify/tree.py).

A proposer plugs in with its own ``expand`` (a draft model: proposers/tree_draft.py; an EAGLE head:
:func:`head_expand` here). EAGLE heads whose layer runs on the CPU kernels skip this module by default: the same tree,
every depth in one native call that feeds each frontier once (specdec/heads/draft_call.py; EagleProposer's
``options.tree_native``). Knows nothing about the target or verification.

Batch 1 (one sequence drafting, the latency case) has a fast path: an ``expand`` that also carries a ``.row``
(:data:`RowExpandFn`) is driven with plain-Python lists of the candidates' tokens, parents and depths, and the
tree's bookkeeping (frontiers, ancestors, the kept set's parents) is done in Python. The ~100 small tensor ops
of the batched path cost ~2 ms per step at batch 1, more than the head's own layer. Every value that decides the
tree (the draft log-probs' top-k, the cumulative scores, the frontier top-k and the final stable sort) is still
computed by the same torch ops on the same values and shapes, so both paths give the same tree, ties included
(``ROW_FAST_PATH = False`` turns the fast path off; the tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.spec_decode.proposer import TreeProposals, TreeShape

__all__ = ["CandidateTree", "ExpandFn", "RowExpandFn", "build_dynamic_tree", "build_ranked_tree", "frontier_subtree", "head_expand"]

ROW_FAST_PATH = True  # batch 1 through the expand's ``.row`` where it has one (see the module docstring)


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

# batch 1: (tokens, parents, depths: one entry per candidate so far, by candidate id; fed: the candidate ids of
# every frontier so far, depth-major, the last k being the frontier to expand) -> [k, V] draft log-probs
RowExpandFn = Callable[[list[int], list[int], list[int], list[int]], torch.Tensor]


def build_dynamic_tree(root_logprobs: torch.Tensor,  # [B, V] draft log-probs after the pending token
                       expand: ExpandFn, shape: TreeShape,
                       ) -> tuple[TreeProposals, torch.Tensor]:  # tree [B, N], candidate id per node [B, N]
    tree, keep, _ = build_ranked_tree(root_logprobs, expand, shape)
    return tree, keep


def build_ranked_tree(root_logprobs: torch.Tensor,  # [B, V] draft log-probs after the pending token
                      expand: ExpandFn, shape: TreeShape,
                      ) -> tuple[TreeProposals, torch.Tensor, torch.Tensor]:
    """:func:`build_dynamic_tree`, and the rank [B, N] int64 of each node among the kept ones (0 = the best
    cumulative draft log-prob; ties: the earlier-made first). The nodes of rank < t are the tree this build
    gives at budget t (the same stable sort picks them), so every such prefix holds its nodes' parents."""
    B, V = root_logprobs.shape
    row = getattr(expand, "row", None)
    if B == 1 and row is not None and ROW_FAST_PATH:
        return _build_row(root_logprobs, row, shape)
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
    keep, rank = torch.sort(cand_sc, dim=1, descending=True, stable=True).indices[:, :N].sort(1)  # [B, N] each
    pos = torch.full((B, C), -1, dtype=torch.long, device=dev)
    pos.scatter_(1, keep, torch.arange(N, device=dev).expand(B, N))
    par_c = cand_par.gather(1, keep)
    parents = torch.where(par_c >= 0, pos.gather(1, par_c.clamp(min=0)), torch.full_like(par_c, -1))
    if bool(((par_c >= 0) & (parents < 0)).any()):  # cannot happen with log-probs <= 0; NaN logits would
        raise RuntimeError("build_dynamic_tree: a kept node's parent was pruned (NaN draft log-probs?)")
    tree = TreeProposals(token_ids=cand_tok.gather(1, keep), parents=parents,
                         num_nodes=torch.full((B,), N, dtype=torch.long, device=dev))
    return tree, keep, rank


def best_first(tree: TreeProposals, rank: torch.Tensor,  # [B, N] int64 0 = best, prefix-closed
               ) -> tuple[TreeProposals, torch.Tensor]:
    """The same trees with each row's nodes in rank order (best first; still topological, since a prefix-closed
    rank puts every parent before its children), and the ranks in that order ([B, N], 0..n-1 then padding).
    A prefix of a row's nodes is then its best nodes, which is what a policy's smaller budget keeps
    (Top1Proposer's cut: the first ``budget`` nodes). Python over B x N ints: a step's few nodes."""
    out_t, out_p, out_r = best_first_rows(tree.token_ids.tolist(), tree.parents.tolist(), tree.num_nodes.tolist(),
                                          rank.tolist())
    dev = tree.token_ids.device
    return (TreeProposals(torch.tensor(out_t, dtype=torch.long, device=dev),
                          torch.tensor(out_p, dtype=torch.long, device=dev), tree.num_nodes),
            torch.tensor(out_r, dtype=torch.long, device=rank.device))


def best_first_rows(toks: list[list[int]], pars: list[list[int]], counts: list[int], ranks: list[list[int]],
                    ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """:func:`best_first` on lists ([B][N] tokens, parents, ranks; [B] node counts) -> (tokens, parents, ranks)."""
    out_t, out_p, out_r = [], [], []
    for t_b, p_b, n, r_b in zip(toks, pars, counts, ranks):
        order = sorted(range(n), key=lambda i: r_b[i])
        at = {i: j for j, i in enumerate(order)}
        if any(p_b[i] >= 0 and at[p_b[i]] > at[i] for i in order):
            raise ValueError("best_first: a node ranks before its parent; the ranks must be prefix-closed")
        pad = len(t_b) - n
        out_t.append([t_b[i] for i in order] + [-1] * pad)
        out_p.append([at[p_b[i]] if p_b[i] >= 0 else -1 for i in order] + [-1] * pad)
        out_r.append(list(range(n)) + r_b[n:])
    return out_t, out_p, out_r


def _build_row(root_logprobs: torch.Tensor,  # [1, V]
               expand: RowExpandFn, shape: TreeShape) -> tuple[TreeProposals, torch.Tensor, torch.Tensor]:
    """build_dynamic_tree at batch 1 with Python bookkeeping; the same torch ops decide every choice."""
    V, dev = root_logprobs.shape[1], root_logprobs.device
    k = min(shape.topk, V)
    sc, tok = root_logprobs.float().topk(k, dim=-1)  # [1, k]
    tokens, parents, depths = tok[0].tolist(), [-1] * k, [1] * k  # per candidate id
    scores = [sc[0]]  # [k], then [k*k] per depth: cumulative draft log-probs in creation order
    frontier, front_sc = list(range(k)), sc[0]  # candidate ids [k] and their scores [k]
    fed = list(frontier)
    for d in range(2, shape.depth + 1):
        child_lp, child_tok = expand(tokens, parents, depths, fed).float().topk(k, dim=-1)  # [k, k]
        child_sc = (front_sc[:, None] + child_lp).reshape(k * k)
        C = len(tokens)
        tokens += child_tok.reshape(-1).tolist()
        parents += [f for f in frontier for _ in range(k)]
        depths += [d] * (k * k)
        scores.append(child_sc)
        best = child_sc[None].topk(k, dim=1).indices.sort(1).values[0]  # [k] best k of this depth
        frontier, front_sc = [C + i for i in best.tolist()], child_sc[best]
        fed += frontier
    cand_sc = torch.cat(scores)[None]  # [1, C]
    N = min(shape.budget, cand_sc.shape[1])
    keep_t, rank = torch.sort(cand_sc, dim=1, descending=True, stable=True).indices[:, :N].sort(1)  # [1, N] each
    keep = keep_t[0].tolist()
    pos = {c: i for i, c in enumerate(keep)}
    if any(parents[c] >= 0 and parents[c] not in pos for c in keep):
        raise RuntimeError("build_dynamic_tree: a kept node's parent was pruned (NaN draft log-probs?)")
    tree = TreeProposals(token_ids=torch.tensor([[tokens[c] for c in keep]], dtype=torch.long, device=dev),
                         parents=torch.tensor([[pos[parents[c]] if parents[c] >= 0 else -1 for c in keep]],
                                              dtype=torch.long, device=dev),
                         num_nodes=torch.full((1,), N, dtype=torch.long, device=dev))
    return tree, keep_t.to(dev), rank.to(dev)


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


def head_expand(head, embed, draft_logits, tree_mask, last: torch.Tensor,  # [A, D] output at each pending pair
                slots: list[int], committed: list[int], pos0: torch.Tensor,  # [A] the pending pairs' positions
                d2t: torch.Tensor | None, vocab: int, shape: TreeShape) -> ExpandFn:
    """``expand`` for an EAGLE head. The head's tree mask covers new pairs only (its cached prefix is always
    visible), so each expansion cuts the slots back to the ``committed`` pairs and re-feeds every frontier
    node so far: node n at depth d is the pair (its parent's head output, or the pending token's for
    d = 1; embed(token n)) at the pending pair's position + d, seeing its ancestors."""
    A, D = last.shape
    k0 = min(shape.topk, vocab)  # children per node (``vocab`` = the draft vocabulary's size)
    # [A, C, D] head output at each candidate node (by candidate id), filled as frontiers are fed
    outs = last.new_zeros(A, k0 + (shape.depth - 1) * k0 * k0, D)

    def expand(cands: CandidateTree, frontiers: list[torch.Tensor]) -> torch.Tensor:
        fed, parents, depths = frontier_subtree(cands, frontiers)  # [A, F], [A, F+1], [A, F]
        F_, k = fed.shape[1], frontiers[-1].shape[1]
        mask = tree_mask(parents)[:, 1:, 1:]  # [A, F, F] ancestors among the fed nodes
        par = cands.parents.gather(1, fed)  # [A, F] candidate id of each fed node's parent, -1 = pending
        # a node's parent was fed, and its output kept, by an earlier expansion
        feat = torch.where((par < 0)[..., None], last[:, None, :],
                           outs.gather(1, par.clamp(min=0)[..., None].expand(A, F_, D)))  # [A, F, D]
        for slot, n in zip(slots, committed):
            head.cache.rollback(slot, n)
        tok = cands.token_ids.gather(1, fed)  # [A, F] draft ids
        tok = tok if d2t is None else d2t[tok]
        rows = [a * F_ + i for a in range(A) for i in range(F_ - k, F_)]  # each sequence's newest k
        o, logits = head.forward_logits(embed(tok.reshape(-1)), feat.reshape(A * F_, D),
                                        (pos0[:, None] + depths).reshape(-1), slots, [F_] * A, rows, draft_logits,
                                        tree_mask=mask.reshape(A * F_, F_))
        newest = o.view(A, F_, D)[:, F_ - k:]  # [A, k, D]
        outs.scatter_(1, fed[:, F_ - k:, None].expand(A, k, D), newest)
        return torch.log_softmax(logits, -1).view(A, k, -1)

    if A != 1:
        return expand
    # batch 1 (build_dynamic_tree's fast path): the same head calls on the same values, lists for the rest.
    # outs1 row 0 = the pending pair's output, row 1 + c = candidate c's
    outs1 = torch.cat([last, outs[0]])  # [1 + C, D]
    p0 = int(pos0[0])

    def expand_row(tokens: list[int], parents: list[int], depths: list[int], fed: list[int]) -> torch.Tensor:
        F_, k = len(fed), k0  # the last k fed nodes are the frontier to expand
        at = {c: i for i, c in enumerate(fed)}  # candidate id -> its index among the fed nodes
        anc: list[list[bool]] = []  # [F, F] ancestor-or-self among the fed nodes (a parent is fed before a child)
        for i, c in enumerate(fed):
            r = list(anc[at[parents[c]]]) if parents[c] >= 0 else [False] * F_
            r[i] = True
            anc.append(r)
        for slot, n in zip(slots, committed):
            head.cache.rollback(slot, n)
        tok = torch.tensor([tokens[c] for c in fed], dtype=torch.long, device=last.device)  # [F] draft ids
        tok = tok if d2t is None else d2t[tok]
        feat = outs1[torch.tensor([parents[c] + 1 for c in fed], device=last.device)]  # [F, D]
        o, logits = head.forward_logits(embed(tok), feat, torch.tensor([p0 + depths[c] for c in fed], device=last.device),
                                        slots, [F_], list(range(F_ - k, F_)), draft_logits,
                                        tree_mask=torch.tensor(anc, dtype=torch.bool, device=last.device))
        outs1[torch.tensor(fed[F_ - k:], device=last.device) + 1] = o[F_ - k:]  # [k, D]
        return torch.log_softmax(logits, -1)

    expand.row = expand_row
    return expand
