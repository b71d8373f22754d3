"""An n-gram branch grafted onto a model-drafted token tree: prompt lookup where a small head drafts badly.

A one-layer EAGLE head predicts the next few tokens from the target's last features; where the answer copies
its prompt (summarisation, RAG, extraction, a quoted passage), prompt lookup (``proposers/ngram.py``) already
knows the continuation, and the head does not. The hybrid lets the target verify both in one forward: the
n-gram draft (up to ``m`` tokens, ``m < budget``; it may reach past the head's depth, TreeProposer.tree_max_path) is
grafted onto the head's dynamic tree as one more root-to-leaf path. Where its first tokens equal a path the head
already drafted, the branch follows that path and only the rest becomes new nodes, so no two siblings carry the
same token. The head drafts a tree of the whole budget, and :func:`graft_within_budget` drops its worst-ranked nodes
until the branch fits: the head keeps every slot the branch does not take. (Until 2026-11-27 the head kept a fixed ``budget - m``, and
a step with no n-gram match, or one that follows the head's path, scored fewer nodes: on the 16 MT-bench
first turns the filled split gives tau 2.305 against 2.198 at the same 7 scored tokens, experiments/LOG.md.)

Where the branch leads (n-gram: after a match of 3 tokens or more, :class:`NGramBranch`), its path's nodes come
first in the tree's order (:func:`lead_with_chain`), so a speculation policy that scores fewer nodes (Top1Proposer's
cut keeps a prefix) keeps the path instead of cutting it first; elsewhere it comes after the head's nodes. Measured
(LOG 2026-12-05 16:16-): the flagship's `ab` 1.014, 1.085, 1.006; eagle3_ngram's goodput over Spec-Bench 13 x 5 with
one fixed start-up table, 1.037 of static against 1.002 without the ordering.

Lossless as every deterministic tree is (``specdec/verify/tree.py``): each node is a one-hot draft, whichever drafter
made it, and the verifier tries siblings against the residual p. The tree is a function of the tokens and the
head's logits only, so greedy output equals plain greedy output and sampled output follows the target.

Which drafter makes the branch is ``options.branch`` (:data:`BRANCHES`): ``ngram`` (default; prompt lookup,
with an index per sequence) or ``suffix`` (suffix decoding's most frequent continuation, proposers/suffix.py, which keeps a trie
per sequence: the proposer frees it through :meth:`Branch.free`). ``options.ngram_branch`` = m stays the
branch's length whichever drafts it.

Knows nothing about heads or the target: token ids in, a tree out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from proposers.ngram import NGramIndex
from proposers.suffix import SuffixBranch
from specdec.spec_decode.proposer import ProposeBatch, TreeProposals

__all__ = ["BRANCHES", "Branch", "NGramBranch", "graft_chains", "graft_within_budget", "lead_rows", "lead_with_chain",
           "make_branch"]


class Branch(Protocol):
    """What drafts the grafted path: up to m token ids per row of the batch, whether each row's path leads (its
    nodes go first in the tree's order, so a speculation policy's cut to fewer nodes keeps them), and per-sequence
    state to free."""

    def chains(self, batch: ProposeBatch, m: int) -> tuple[list[list[int]], list[bool]]: ...

    def free(self, seq_id: int) -> None: ...


class NGramBranch:
    """Prompt lookup (proposers/ngram.py's incremental index) with the config's ``prompt_lookup_min`` /
    ``prompt_lookup_max``, its length and place by the match's length (NGramIndex.match_length): a match of
    ``LONG_FROM`` tokens or more drafts all m tokens and leads the tree's order; a shorter one drafts at most
    ``SHORT`` tokens after the head's nodes. Measured on SmolLM2's Spec-Bench outputs (experiments/bench/
    ngram_classes.py, LOG 2026-12-05): a 3-gram match's draft accepted 4.7 tokens on average, a 2-gram's 1.7, a
    1-gram's 0.6, while a 3-deep head tree accepts at most 3."""

    LONG_FROM, SHORT = 3, 3

    def __init__(self, config) -> None:
        self.index = NGramIndex(config.prompt_lookup_min, config.prompt_lookup_max)

    def chains(self, batch: ProposeBatch, m: int) -> tuple[list[list[int]], list[bool]]:
        srcs = batch.sequences if batch.sequences is not None else batch.token_ids
        k_of = (lambda n: m if n >= self.LONG_FROM else min(m, self.SHORT))  # the draft's length by its match's
        out, lead = [], []
        for s, src in zip(batch.seq_ids, srcs):
            chain, n = self.index.draft(s, src, k_of)
            out.append(chain)
            lead.append(n >= self.LONG_FROM and bool(chain))
        return out, lead

    def free(self, seq_id: int) -> None:
        self.index.free(seq_id)


BRANCHES: dict[str, type] = {"ngram": NGramBranch, "suffix": SuffixBranch}  # options.branch -> its class


def make_branch(name: str, owner: str, config) -> Branch:
    """The branch drafter ``options.branch`` names, for proposer ``owner`` (named in the error)."""
    if name not in BRANCHES:
        raise ValueError(f"{owner}: options.branch={name!r} is not a branch drafter; one of {sorted(BRANCHES)}")
    return BRANCHES[name](config)


def lead_with_chain(t: list[int], p: list[int], chain: Sequence[int]) -> tuple[list[int], list[int]]:
    """One row's (tokens, parents) reordered so that ``chain``'s path from the root (grafted: every token of it
    is a node) comes first, then the other nodes in their order: still topological (the path's nodes' parents are
    on it), the same tree. A cut to the first n nodes then keeps the path's first n."""
    children = {(p[i], t[i]): i for i in range(len(t))}
    path, cur = [], -1
    for tok in chain:
        cur = children[(cur, int(tok))]
        path.append(cur)
    on = set(path)
    order = path + [i for i in range(len(t)) if i not in on]
    at = {i: j for j, i in enumerate(order)}
    return [t[i] for i in order], [at[p[i]] if p[i] >= 0 else -1 for i in order]


def lead_rows(rows: list[tuple[list[int], list[int]]], chains: Sequence[Sequence[int]],
              lead: Sequence[bool]) -> list[tuple[list[int], list[int]]]:
    """Grafted rows (tokens, parents), those where ``lead`` says so reordered by :func:`lead_with_chain`."""
    return [lead_with_chain(t, p, c) if ld else (t, p) for (t, p), c, ld in zip(rows, chains, lead)]


def graft_chains(tree: TreeProposals, chains: Sequence[Sequence[int]]) -> TreeProposals:
    """``tree`` ([B, N] nodes in topological order, deterministic) with ``chains[b]`` (target token ids, may be
    empty) grafted onto row b as a root-to-leaf path -> [B, N'] with N' <= N + max len(chains[b])."""
    B = _check(tree, chains)
    toks, pars, counts = tree.token_ids.tolist(), tree.parents.tolist(), tree.num_nodes.tolist()
    rows = [_graft_row(toks[b][:counts[b]], pars[b][:counts[b]], chains[b]) for b in range(B)]
    return stack_rows(rows, tree.token_ids.shape[1], tree.token_ids.device)


def graft_within_budget(tree: TreeProposals, rank: torch.Tensor,  # [B, N] int64 rank of each node, 0 = best
                        chains: Sequence[Sequence[int]], budget: int) -> TreeProposals:
    """:func:`graft_chains` that keeps each row within ``budget`` nodes by dropping the head's worst-ranked
    nodes: row b keeps its nodes of rank < t for the largest t at which they and the grafted chain fit. A
    chain that follows the head's own path costs no room, and no chain costs none, so the head keeps every
    slot the branch does not take (a fixed split of budget - m head nodes leaves them empty). ``rank``
    must be prefix-closed (a node's parent ranks before it), as ``build_ranked_tree`` gives it.
    -> [B, N'] with every num_nodes <= budget."""
    B = _check(tree, chains)
    rows = graft_rows_within_budget(tree.token_ids.tolist(), tree.parents.tolist(), tree.num_nodes.tolist(),
                                    rank.tolist(), chains, budget)
    return stack_rows(rows, 0, tree.token_ids.device)


def graft_rows_within_budget(toks: list[list[int]], pars: list[list[int]], counts: list[int], ranks: list[list[int]],
                             chains: Sequence[Sequence[int]], budget: int) -> list[tuple[list[int], list[int]]]:
    """:func:`graft_within_budget` on lists ([B][N] tokens, parents, ranks; [B] node counts; deterministic trees)
    -> each row's (tokens, parents); :func:`stack_rows` makes the proposals."""
    rows = []
    for b in range(len(counts)):
        if len(chains[b]) > budget:
            raise ValueError(f"graft_within_budget: row {b}'s chain has {len(chains[b])} tokens > budget={budget}")
        n, t_b, p_b, r_b = counts[b], toks[b], pars[b], ranks[b]
        for t in range(min(n, budget), -1, -1):
            keep = [i for i in range(n) if r_b[i] < t]  # topological order kept
            at = {i: j for j, i in enumerate(keep)}
            if any(p_b[i] >= 0 and p_b[i] not in at for i in keep):
                raise ValueError(f"graft_within_budget: row {b}: a node of rank < {t} has a parent of rank >= "
                                 f"{t}; the ranks must put every parent before its children")
            row = _graft_row([t_b[i] for i in keep], [at[p_b[i]] if p_b[i] >= 0 else -1 for i in keep], chains[b])
            if len(row[0]) <= budget:
                break
        rows.append(row)
    return rows


def _check(tree: TreeProposals, chains: Sequence[Sequence[int]]) -> int:
    B = tree.token_ids.shape[0]
    if len(chains) != B:
        raise ValueError(f"graft_chains: {len(chains)} chains for a tree of {B} rows")
    if tree.draft_probs is not None:
        raise ValueError("graft_chains: the tree carries draft_probs (sampled nodes); grafting a deterministic "
                         "branch onto it would change the law its siblings were drawn from; graft onto "
                         "deterministic (top-k) trees only")
    return B


def _graft_row(t: list[int], p: list[int], chain: Sequence[int]) -> tuple[list[int], list[int]]:
    """One row's (tokens, parents) with ``chain`` grafted on from the root, following existing nodes."""
    t, p = list(t), list(p)
    children: dict[tuple[int, int], int] = {(p[i], t[i]): i for i in range(len(t))}  # (parent, token) -> node
    cur = -1
    for tok in chain:
        node = children.get((cur, int(tok)))
        if node is None:  # a new node under the current one
            node = len(t)
            t.append(int(tok))
            p.append(cur)
            children[(cur, int(tok))] = node
        cur = node
    return t, p


def stack_rows(rows: list[tuple[list[int], list[int]]], width: int, dev) -> TreeProposals:
    """Rows padded in Python, then one tensor each (per-row tensor writes cost ~0.1 ms a step at batch 1)."""
    width = max(width, max((len(t) for t, _ in rows), default=0))
    pad = [[-1] * (width - len(t)) for t, _ in rows]
    token_ids = torch.tensor([t + q for (t, _), q in zip(rows, pad)], dtype=torch.long, device=dev)  # [B, N'] -1 = padding
    parents = torch.tensor([p + q for (_, p), q in zip(rows, pad)], dtype=torch.long, device=dev)  # [B, N']
    num_nodes = torch.tensor([len(t) for t, _ in rows], dtype=torch.long, device=dev)  # [B]
    return TreeProposals(token_ids.view(len(rows), width), parents.view(len(rows), width), num_nodes)
