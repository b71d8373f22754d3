"""An n-gram branch grafted onto a model-drafted token tree: prompt lookup where a small head drafts badly.

A one-layer EAGLE head predicts the next few tokens from the target's last features; where the answer copies
its prompt (summarisation, RAG, extraction, a quoted passage), prompt lookup (``proposers/ngram.py``) already
knows the continuation, and the head does not. The hybrid lets the target verify both in one forward: the
head's dynamic tree keeps ``budget - m`` nodes and the n-gram draft (up to ``m`` tokens, ``m <= depth``) is
grafted on as one more root-to-leaf path. Where its first tokens equal a path the head already drafted, the
branch follows that path and only the rest becomes new nodes, so no two siblings carry the same token.

Lossless as every deterministic tree is (``specdec/tree.py``): each node is a one-hot draft, whichever drafter
made it, and the verifier tries siblings against the residual p. The tree is a function of the tokens and the
head's logits only, so greedy output equals plain greedy output and sampled output follows the target.

Knows nothing about heads or the target: token ids in, a tree out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.tree import TreeProposals

__all__ = ["graft_chains"]


def graft_chains(tree: TreeProposals, chains: Sequence[Sequence[int]]) -> TreeProposals:
    """``tree`` ([B, N] nodes in topological order, deterministic) with ``chains[b]`` (target token ids, may be
    empty) grafted onto row b as a root-to-leaf path -> [B, N'] with N' <= N + max len(chains[b])."""
    B, N = tree.token_ids.shape
    if len(chains) != B:
        raise ValueError(f"graft_chains: {len(chains)} chains for a tree of {B} rows")
    if tree.draft_probs is not None:
        raise ValueError("graft_chains: the tree carries draft_probs (sampled nodes); grafting a deterministic "
                         "branch onto it would change the law its siblings were drawn from; graft onto "
                         "deterministic (top-k) trees only")
    toks, pars, counts = tree.token_ids.tolist(), tree.parents.tolist(), tree.num_nodes.tolist()
    rows_t, rows_p = [], []
    for b in range(B):
        n = int(counts[b])
        t, p = toks[b][:n], pars[b][:n]
        children: dict[tuple[int, int], int] = {(p[i], t[i]): i for i in range(n)}  # (parent, token) -> node
        cur = -1
        for tok in chains[b]:
            node = children.get((cur, int(tok)))
            if node is None:  # a new node under the current one
                node = len(t)
                t.append(int(tok))
                p.append(cur)
                children[(cur, int(tok))] = node
            cur = node
        rows_t.append(t)
        rows_p.append(p)
    width = max(N, max(map(len, rows_t), default=0))
    dev = tree.token_ids.device
    token_ids = torch.full((B, width), -1, dtype=torch.long)  # [B, N'] -1 = padding
    parents = torch.full((B, width), -1, dtype=torch.long)  # [B, N']
    for b in range(B):
        token_ids[b, : len(rows_t[b])] = torch.tensor(rows_t[b], dtype=torch.long)
        parents[b, : len(rows_p[b])] = torch.tensor(rows_p[b], dtype=torch.long)
    num_nodes = torch.tensor([len(t) for t in rows_t], dtype=torch.long)  # [B]
    return TreeProposals(token_ids.to(dev), parents.to(dev), num_nodes.to(dev))
