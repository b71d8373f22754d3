"""Tree verification ops: the attention mask of a token tree, and greedy acceptance of its longest path.

A tree of N nodes is a parent array: ``parents[0] = -1`` (the root: the last committed token) and
``0 <= parents[i] < i`` for every other node (topological order, as tree proposers emit them). Node i's
token is a draft for the position after its parent. Knows nothing about how the tree was proposed.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def build_tree_mask_ref(parents: torch.Tensor,  # [..., N] int64, -1 for the root
                        ) -> torch.Tensor:  # [..., N, N] bool: mask[i, j] = j is i or an ancestor of i
    N = parents.shape[-1]
    if parents.device.type == "cpu" and 0 < parents.numel() <= 4096:
        p = parents.reshape(-1, N).tolist()
        if all(q < i for row in p for i, q in enumerate(row)):  # topological: one row copy per node
            # a draft step builds a few masks of ~10 nodes: ~10 us here against ~0.2 ms for the doubling below
            m = np.zeros((len(p), N, N), dtype=bool)
            for mb, row in zip(m, p):
                for i, q in enumerate(row):
                    if q >= 0:
                        mb[i] = mb[q]
                    mb[i, i] = True
            return torch.from_numpy(m).reshape(*parents.shape, N)
    eye = torch.eye(N, dtype=torch.bool, device=parents.device)
    step = eye | (torch.nn.functional.one_hot(parents.clamp(min=0), N).bool() & (parents >= 0)[..., None])
    # reachability by path doubling: after t squarings, every ancestor up to 2^t levels up is marked
    mask = step.expand(*parents.shape, N)
    for _ in range(max(1, math.ceil(math.log2(N)))):
        m = mask.to(torch.float32)
        mask = (m @ m) > 0
    return mask


def tree_greedy_accept_ref(parents: torch.Tensor,  # [B, N] int64 parent arrays (see module doc)
                           node_token_ids: torch.Tensor,  # [B, N] int64 draft token of each node (root's ignored)
                           target_argmax: torch.Tensor,  # [B, N] int64 target argmax of the token after node i
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest accepted root-to-node path under greedy matching (ties: lowest node index).

    Returns ``path`` [B, N] int64 (node indices from the root, -1 padded) and ``out`` [B, N] int64
    (emitted tokens: the accepted nodes' tokens then the target's argmax after the deepest one, -1 padded).
    """
    B, N = parents.shape
    if parents.device.type == "cpu" and 0 < B * N <= 4096:
        fast = _greedy_accept_lists(parents.tolist(), node_token_ids.tolist(), target_argmax.tolist())
        if fast is not None:
            return fast
    return _greedy_accept_tensors(parents, node_token_ids, target_argmax)


def _greedy_accept_tensors(parents: torch.Tensor, node_token_ids: torch.Tensor, target_argmax: torch.Tensor,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_greedy_accept_ref as tensor ops, for any device, batch and node order."""
    B, N = parents.shape
    rows = torch.arange(B, device=parents.device)
    idx = torch.arange(N, device=parents.device)
    mask = build_tree_mask_ref(parents)  # [B, N, N]
    match = node_token_ids == target_argmax.gather(1, parents.clamp(min=0))  # [B, N]
    match[:, 0] = True  # the root is committed
    accepted = ~(mask & ~match[:, None, :]).any(dim=-1)  # [B, N]: every node on its path matched
    depth = mask.sum(dim=-1) - 1  # [B, N]
    score = torch.where(accepted, depth * N + (N - 1 - idx), torch.full_like(depth, -1))
    best = score.argmax(dim=1)  # [B] deepest accepted node
    on_path = mask[rows, best]  # [B, N]
    L = depth[rows, best]  # [B] accepted drafts
    # path[depth[j]] = j for each j on the path; other nodes go to a discarded column N
    slot = torch.where(on_path, depth, torch.full_like(depth, N))
    path = torch.full((B, N + 1), -1, dtype=torch.int64, device=parents.device)
    path.scatter_(1, slot, idx.expand(B, N).clone())
    path = path[:, :N]
    tokens = node_token_ids.gather(1, path.clamp(min=0))  # [B, N]
    drafts = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # emitted position d = node at depth d+1
    final = target_argmax[rows, best]  # [B]
    out = torch.where(idx < L[:, None], drafts, final[:, None])
    return path, out.masked_fill_(idx > L[:, None], -1)


def _greedy_accept_lists(parents: list[list[int]], tokens: list[list[int]], argmax: list[list[int]],
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """tree_greedy_accept_ref's result for a few small CPU trees, walked in Python: a verification step
    scores one ~7-node tree per sequence, where the ~25 tensor ops of the general path cost ~0.3 ms on the
    2-core box and this ~10 us. The same rule: a node is accepted when it and every ancestor match the
    target's argmax after their parent (the root always); the deepest accepted node wins, the lowest index
    on ties. None (the caller takes the general path) unless every row is topological (parents[i] < i)."""
    paths, outs = [], []
    for par, tok, am in zip(parents, tokens, argmax):
        N = len(par)
        if any(q >= i for i, q in enumerate(par)):
            return None
        ok, depth = [True] * N, [0] * N
        best = 0
        for i in range(1, N):
            q = par[i]
            ok[i] = tok[i] == am[max(q, 0)] and (q < 0 or ok[q])
            depth[i] = depth[q] + 1 if q >= 0 else 0  # a second root (parent -1) stays at depth 0
            if ok[i] and depth[i] > depth[best]:  # strictly deeper: on ties the lower index stays
                best = i
        chain, j = [], best
        while j >= 0:
            chain.append(j)
            j = par[j]
        chain.reverse()  # root .. best, one node per depth
        L = len(chain) - 1
        paths.append(chain + [-1] * (N - L - 1))
        outs.append([tok[j] for j in chain[1:]] + [am[best]] + [-1] * (N - L - 1))
    return torch.tensor(paths, dtype=torch.int64), torch.tensor(outs, dtype=torch.int64)
