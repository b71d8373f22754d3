"""Lossless verification of a token tree (greedy longest path, or multi-draft recursive rejection sampling).
The tree proposer contract (TreeShape, TreeProposer) is in specdec/spec_decode/proposer.py.

A tree of N draft nodes per sequence hangs off the sequence's pending token (the last committed token,
which the target has not run yet). Node i drafts the token after its parent: ``parents[i] = -1`` means
after the pending token, else ``0 <= parents[i] < i`` (topological order). Nodes past ``num_nodes[b]``
are padding (token -1). The kernel ops (``specdec_kernels/tree.py``) use the *root-inclusive* layout: node 0 is
the pending token and draft node i is node i+1; :meth:`TreeProposals.with_root` converts.

Sampling rule (SpecInfer's multi-step speculative sampling / Jeon et al. 2024 recursive rejection
sampling, the EAGLE evaluate_posterior rule for one-hot drafts). Start at the root with the target's p.
Try the children of the current node in index order: child x, drawn from q (``draft_probs`` of that
node: the law it was drawn from *given its earlier siblings*), is accepted with probability
min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)) and the next sibling is tried. An accepted child
becomes the current node (p <- the target at it). When every child is rejected (or there is none) the
step emits one token from the current p. Each sibling test is an ordinary speculative-sampling step
against the current residual, so the emitted tokens follow the target exactly, for children drawn with
replacement (q the same for all), without replacement (q with earlier siblings removed, renormalised),
or deterministically (``draft_probs=None``: q one-hot, accept with p(x), remove x from p). A tree whose
children were *pruned by their own sampled values* would bias q; deterministic trees (EAGLE-2's top-k)
are immune, which is why proposers/tree_draft.py builds those.

Knows nothing about models, KV caches or request state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec_kernels import get_ops
from specdec_kernels.noise import draw_exponential, draw_uniform
from specdec.interfaces import SpeculativeProposals, Verdict
from specdec.sampling.sampler import argmax_last
from specdec.datamodel.sampling_params import SamplingParams
from specdec.verify.rows import split_rows

__all__ = ["TreeVerifier", "ends_at_leaf", "tree_rejection_sample"]


def tree_rejection_sample(parents: torch.Tensor,  # [B, M] int64 root-inclusive (node 0 = pending token)
                          token_ids: torch.Tensor,  # [B, M] int64; -1 = padding; node 0's is ignored
                          target_probs: torch.Tensor,  # [B, M, V] float p of the token after node i
                          draft_probs: torch.Tensor | None,  # [B, M, V] q of node i (row 0 unused); None = one-hot
                          uniform: torch.Tensor,  # [B, M] float32 in [0, 1): one coin per node
                          exp_noise: torch.Tensor,  # [B, V] float32 Exp(1) > 0 for the one final token
                          ) -> tuple[torch.Tensor, torch.Tensor]:  # path [B, M], out [B, M]
    """Multi-draft recursive rejection sampling over a tree (module docstring). Same outputs as
    ``tree_greedy_accept``: ``path`` = accepted node indices from the root (-1 padded), ``out`` = accepted
    tokens then the final one (the residual's sample, or the bonus after a leaf), -1 padded."""
    B, M = parents.shape
    dev = parents.device
    rows = torch.arange(B, device=dev)
    is_child = token_ids >= 0
    is_child[:, 0] = False
    path = torch.full((B, M), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    out = torch.full((B, M), -1, dtype=torch.long, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # the deepest accepted node
    p = target_probs[:, 0].float()  # [B, V] the current target (residual) at cur
    live = torch.ones(B, dtype=torch.bool, device=dev)  # rows still descending
    for d in range(M - 1):
        kids = is_child & (parents == cur[:, None]) & live[:, None]  # [B, M] children of cur
        n_kids = kids.sum(1)
        if not bool(n_kids.any()):
            break
        rank = kids.cumsum(1) - 1  # sibling order (= node index order)
        found = torch.full((B,), -1, dtype=torch.long, device=dev)
        for r in range(int(n_kids.max())):
            sel = kids & (rank == r)  # [B, M], at most one per row
            has = sel.any(1) & (found < 0)
            j = sel.to(torch.int8).argmax(1)  # [B] the r-th child (garbage where not `has`)
            x = token_ids[rows, j].clamp(min=0)
            p_x = p[rows, x]
            if draft_probs is None:  # one-hot q: accept with p(x), residual = p with x removed
                accept = has & (uniform[rows, j] < p_x)
                resid = p.scatter(1, x[:, None], 0.0)
            else:  # u < min(1, p/q) <=> u * q < p (no division; q(x) = 0 accepts iff p(x) > 0)
                q = draft_probs[rows, j].float()
                accept = has & (uniform[rows, j] * q[rows, x] < p_x)
                resid = (p - q).clamp_(min=0.0)
            found = torch.where(accept, j, found)
            s = resid.sum(1, keepdim=True)
            # max(p - q, 0) = 0 only when p == q, where rejection has probability 0: keep p if rounding got there
            resid = torch.where(s > 0, resid / s.clamp(min=1e-30), p)
            p = torch.where((has & ~accept)[:, None], resid, p)
        went = found >= 0
        path[:, d + 1] = torch.where(went, found, path[:, d + 1])
        out[:, d] = torch.where(went, token_ids[rows, found.clamp(min=0)], out[:, d])
        p = torch.where(went[:, None], target_probs[rows, found.clamp(min=0)].float(), p)
        cur = torch.where(went, found, cur)
        live &= went
    n_acc = (path >= 0).sum(1) - 1  # [B]
    out[rows, n_acc] = (p / exp_noise).argmax(1)  # exponential race: a draw from p
    return path, out


class TreeVerifier:
    """Verifies a token tree from raw target logits and per-request SamplingParams. Greedy rows: exact
    longest-path matching (``specdec_kernels.get_ops(kernel).tree_greedy_accept``); the others: lossless
    :func:`tree_rejection_sample` on the processed target (temperature, top-k, top-p, min-p).
    Randomness per random row: ``noise_width`` (>= M) uniforms, then one [V] Exp(1) row, from its
    generator when seeded; a fixed width (budget + 1) keeps a seeded row's draws independent of the
    other rows' tree sizes. The tree half of :class:`specdec.verify.chain.RejectionSampler`."""

    def __init__(self, kernel: str = "torch") -> None:
        self.kernel = kernel
        self.ops = get_ops(kernel)

    def verify(self, target_logits: torch.Tensor,  # [B, M, V] raw logits after each root-inclusive node
               parents: torch.Tensor,  # [B, M] int64 root-inclusive
               token_ids: torch.Tensor,  # [B, M] int64 root-inclusive, -1 = padding
               draft_probs: torch.Tensor | None,  # [B, M, V] root-inclusive, None = one-hot drafts
               params: Sequence[SamplingParams],  # [B]
               generators: Sequence[torch.Generator | None] | None = None,  # [B]
               noise_width: int | None = None,  # uniforms drawn per random row (None = M)
               target_argmax: torch.Tensor | None = None,  # [B, M] int64 argmax of target_logits, if known
               ) -> tuple[torch.Tensor, torch.Tensor]:  # path [B, M], out [B, M] int64, -1 padded
        B, M, V = target_logits.shape
        if parents.shape != (B, M) or token_ids.shape != (B, M) or len(params) != B:
            raise ValueError(f"TreeVerifier.verify: logits {tuple(target_logits.shape)}, parents "
                             f"{tuple(parents.shape)}, token_ids {tuple(token_ids.shape)}, {len(params)} params; "
                             f"expected [B, M, V], [B, M], [B, M], B")
        if noise_width is not None and noise_width < M:
            raise ValueError(f"TreeVerifier.verify: noise_width={noise_width} < {M} nodes per row (budget + 1)")
        split = split_rows(params, target_logits.device)
        greedy = None
        if split.rows != list(range(B)):
            greedy = self.ops.tree_greedy_accept(parents, token_ids,
                                                 argmax_last(target_logits) if target_argmax is None else target_argmax)
            if not split.rows:
                return greedy
        rows = torch.tensor(split.rows, device=target_logits.device)
        m = len(split.rows)
        probs = split.st_random.expand(M, kernel=self.kernel).to_probs(
            target_logits.index_select(0, rows).reshape(m * M, V), kernel=self.kernel).view(m, M, V)
        gens = split.generators(generators)
        uniform = draw_uniform(m, noise_width or M, gens, device=target_logits.device)[:, :M]
        exp_noise = draw_exponential(m, V, gens, device=target_logits.device)
        q = None if draft_probs is None else draft_probs.index_select(0, rows)
        path, out = tree_rejection_sample(parents.index_select(0, rows), token_ids.index_select(0, rows),
                                          probs, q, uniform, exp_noise)
        if greedy is None:
            return path, out
        return greedy[0].index_copy(0, rows, path), greedy[1].index_copy(0, rows, out)

    def verify_proposals(self, target_logits: torch.Tensor,  # [B, N+1, V]
                         proposals: SpeculativeProposals, root_token_ids: torch.Tensor,  # [B]
                         params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                         target_argmax: torch.Tensor | None = None,  # [B, N+1] int64, if known
                         ) -> Verdict:
        dev = target_logits.device
        parents, tokens = proposals.with_root(root_token_ids)
        q = proposals.draft_probs_with_root()
        path, out = self.verify(target_logits, parents.to(dev), tokens.to(dev), None if q is None else q.to(dev),
                                params, generators, noise_width=proposals.noise_width, target_argmax=target_argmax)
        return Verdict(path.cpu(), out.cpu())


def ends_at_leaf(proposals: SpeculativeProposals, verdict: Verdict) -> torch.Tensor:  # [B] bool
    """Whether a row's deepest accepted node has no child among its real nodes (the emitted token is then
    a bonus: the proposer produced that node but never ran it). A chain: all k drafts accepted."""
    parents, nodes = proposals.parents.tolist(), proposals.num_nodes.tolist()
    leaf = []
    for par, n, path in zip(parents, nodes, verdict.accepted_paths):
        a, last = len(path) - 1, path[-1]  # root-inclusive; its children: the real nodes i with par[i] + 1 == last
        leaf.append(a > 0 and all(q + 1 != last for q in par[:n]))
    return torch.tensor(leaf, dtype=torch.bool)


