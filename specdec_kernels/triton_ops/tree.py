"""Triton tree ops: ancestor mask of a parent array and greedy longest accepted path; references and the
tree conventions (``parents[0] = -1``, ``parents[i] < i``) in ``specdec_kernels/tree.py``.

Both walk up the parent pointers of all nodes at once, one gather per level, for N levels (the deepest
possible chain; N is a runtime argument, so no early exit is needed for correctness and a malformed array
with a cycle still terminates). The path is then read by one walk up from the chosen node.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.triton_ops._common import INTS, check_device, check_dtype, check_shape, pow2, tile_elems


@triton.jit(do_not_specialize=["N"])
def _tree_mask_kernel(parents_ptr,  # [T, N] contiguous
                      out_ptr,  # [T, N, N] bool
                      N,
                      BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nodes = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # rows i of the mask
    cols = tl.arange(0, BLOCK_J)
    par = parents_ptr + t * N
    cur = tl.where(nodes < N, nodes, -1).to(tl.int64)  # walks from i up to the root
    mask = tl.zeros([BLOCK_I, BLOCK_J], tl.int1)
    for _ in range(N):
        mask |= cols[None, :] == cur[:, None]
        cur = tl.load(par + tl.maximum(cur, 0), mask=cur >= 0, other=-1).to(tl.int64)
    tl.store(out_ptr + t * N * N + nodes[:, None] * N + cols[None, :], mask,
             mask=(nodes[:, None] < N) & (cols[None, :] < N))


def build_tree_mask(parents: torch.Tensor,  # [..., N] int64, -1 for the root
                    ) -> torch.Tensor:  # [..., N, N] bool: mask[i, j] = j is i or an ancestor of i
    op = "build_tree_mask[triton]"
    check_dtype(op, "parents", parents, INTS)
    if parents.dim() == 0:
        raise ValueError(f"{op}: parents is a scalar; expected [..., N].")
    N = parents.shape[-1]
    out = torch.empty(*parents.shape, N, dtype=torch.bool, device=parents.device)
    flat = parents.reshape(-1, N).contiguous()
    T = flat.shape[0]
    if T * N == 0:
        return out
    BLOCK_J = pow2(N)
    BLOCK_I = max(1, min(tile_elems() // BLOCK_J, BLOCK_J))
    _tree_mask_kernel[(T, triton.cdiv(N, BLOCK_I))](flat, out, N, BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J)
    return out


@triton.jit
def _matched(par, tok_ptr, am_ptr, node):
    """[n] bool: node's draft equals the target's argmax after its parent (the root always matches)."""
    live = node >= 0
    safe = tl.maximum(node, 0)
    parent = tl.load(par + safe, mask=live, other=-1).to(tl.int64)
    tok = tl.load(tok_ptr + safe, mask=live, other=-1).to(tl.int64)
    target = tl.load(am_ptr + tl.maximum(parent, 0), mask=live, other=-2).to(tl.int64)
    return (tok == target) | (node == 0), parent


@triton.jit(do_not_specialize=["N"])
def _tree_greedy_kernel(parents_ptr, s_p,  # [B, N]
                        tokens_ptr, s_t,  # [B, N]
                        argmax_ptr, s_a,  # [B, N]
                        path_ptr, out_ptr,  # [B, N] int64 each, contiguous
                        N,
                        BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    par = parents_ptr + b * s_p
    tok_ptr = tokens_ptr + b * s_t
    am_ptr = argmax_ptr + b * s_a
    idx = tl.arange(0, BLOCK_N)
    valid = idx < N
    # accepted[i]: every node from i up to the root matched; depth[i] = number of proper ancestors
    cur = tl.where(valid, idx, -1).to(tl.int64)
    accepted = valid
    depth = tl.full([BLOCK_N], -1, tl.int64)
    for _ in range(N):
        live = cur >= 0
        ok, parent = _matched(par, tok_ptr, am_ptr, cur)
        accepted &= ok | ~live
        depth += live.to(tl.int64)
        cur = tl.where(live, parent, -1)
    # deepest accepted node, ties -> lowest index (scores are distinct); the root is always accepted
    score = tl.where(accepted, depth * N + (N - 1 - idx), -1)
    best = tl.argmax(score, axis=0).to(tl.int64)
    L = tl.sum(tl.where(idx == best, depth, 0), axis=0)  # accepted drafts
    final = tl.load(am_ptr + best).to(tl.int64)
    # walk up from best: the node at depth d is path[d]; its token is emitted at position d - 1
    path = tl.full([BLOCK_N], -1, tl.int64)
    out = tl.where(idx == L, final, -1)
    node = best
    d = L
    for _ in range(N):
        live = node >= 0
        path = tl.where(live & (idx == d), node, path)
        tok = tl.load(tok_ptr + tl.maximum(node, 0), mask=live, other=-1).to(tl.int64)
        out = tl.where(live & (d >= 1) & (idx == d - 1), tok, out)
        node = tl.where(live, tl.load(par + tl.maximum(node, 0), mask=live, other=-1).to(tl.int64), -1)
        d -= 1
    tl.store(path_ptr + b * N + idx, path, mask=valid)
    tl.store(out_ptr + b * N + idx, out, mask=valid)


def tree_greedy_accept(parents: torch.Tensor,  # [B, N] int64 parent arrays (see specdec_kernels/tree.py)
                       node_token_ids: torch.Tensor,  # [B, N] int64 draft token of each node (root's ignored)
                       target_argmax: torch.Tensor,  # [B, N] int64 target argmax of the token after node i
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # path [B, N], out [B, N] (see the ref)
    op = "tree_greedy_accept[triton]"
    for name, t in (("parents", parents), ("node_token_ids", node_token_ids), ("target_argmax", target_argmax)):
        check_dtype(op, name, t, INTS)
    check_shape(op, "parents", parents, (None, None))
    B, N = parents.shape
    check_shape(op, "node_token_ids", node_token_ids, (B, N))
    check_shape(op, "target_argmax", target_argmax, (B, N))
    dev = check_device(op, parents, node_token_ids, target_argmax)
    path = torch.empty(B, N, dtype=torch.int64, device=dev)
    out = torch.empty(B, N, dtype=torch.int64, device=dev)
    if B * N == 0:
        return path, out
    # the walks gather along each row: unit stride in the node dimension
    parents, node_token_ids, target_argmax = (t if t.stride(1) == 1 else t.contiguous()
                                              for t in (parents, node_token_ids, target_argmax))
    _tree_greedy_kernel[(B,)](parents, parents.stride(0), node_token_ids, node_token_ids.stride(0),
                              target_argmax, target_argmax.stride(0), path, out, N, BLOCK_N=pow2(N))
    return path, out
