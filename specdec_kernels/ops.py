"""``KernelOps``: what one backend of :mod:`kernels` provides, an implementation of every op.

The bottom of the package's imports (no torch, no triton): the registry in ``specdec_kernels/__init__.py`` and each
backend's loader (``specdec_kernels/triton_ops/__init__.py``) build one, so neither imports the other to get it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["KernelOps"]


@dataclass(frozen=True)
class KernelOps:
    """One backend's implementation of every op; each field has the signature of its ``*_ref``."""

    name: str
    # verification (specdec_kernels/greedy_verify.py, rejection.py, typical.py, output.py)
    greedy_verify: Callable  # (target_argmax [B,k+1], draft_token_ids [B,k]) -> out [B,k+1]
    # (target_probs [B,>=k,V], draft_probs [B,k,V]|None, draft_ids [B,k], uniform [B,k]) -> [B,k] bool
    rejection_accept: Callable
    # (target_probs [B,K,V], draft_probs|None, draft_ids [B,k], position [B], exp_noise [B,V]) -> [B]
    sample_recovered: Callable
    # (target_probs [B,>=k,V], draft_ids [B,k], posterior_threshold, posterior_alpha) -> [B,k] bool
    typical_accept: Callable
    num_accepted: Callable  # (accepted [B,k] bool) -> [B] int64 (length of the accepted prefix)
    create_output: Callable  # (accepted [B,k], draft_ids [B,k], recovered [B], bonus [B]) -> out [B,k+1]
    # sampling parameters (specdec_kernels/expand.py, sampling_filters.py)
    expand_per_token: Callable  # (x [B,...], num_tokens int|[B]) -> [sum(num_tokens),...]
    apply_temperature: Callable  # (logits [N,V], temperature [N]) -> [N,V]
    apply_top_k_top_p: Callable  # (logits [N,V], top_k [N]|None, top_p [N]|None) -> [N,V]
    apply_min_p: Callable  # (logits [N,V], min_p [N]) -> [N,V]
    # trees (specdec_kernels/tree.py)
    build_tree_mask: Callable  # (parents [...,N]) -> mask [...,N,N] bool
    # (parents [B,N], node_token_ids [B,N], target_argmax [B,N]) -> (path [B,N], out [B,N])
    tree_greedy_accept: Callable
    # (k_cache [L,S,H,M,D], v_cache, slot, src_indices [n], dst_start) -> None, in place (specdec_kernels/kv_compact.py)
    kv_compact: Callable
