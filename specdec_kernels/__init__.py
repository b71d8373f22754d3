"""Compute ops of speculative decoding: one torch reference per op, a Triton kernel for each.

Every op is a plain function over tensors with its shapes written on each argument; none knows about
requests, ``SamplingParams``, models or batches of Python objects. Randomness is drawn *outside* the
ops (:mod:`specdec_kernels.noise`: per-row ``torch.Generator`` or one shared draw) and passed in as uniform /
exponential noise tensors, so a Triton launcher can share each reference's signature exactly.

Callers never import an implementation module directly; they pick a backend by name::

    ops = specdec_kernels.get_ops("torch")          # a KernelOps namespace
    out = ops.greedy_verify(target_argmax, draft_token_ids)

Backends: ``"torch"`` (the ``*_ref`` functions in ``specdec_kernels/<op>.py``) and ``"triton"`` (the kernels in
``specdec_kernels/triton_ops/<op>.py``, same signatures; imported only by ``get_ops("triton")``, and without a
GPU run by Triton's CPU interpreter, which is logged once). A new backend registers a loader
(``register_ops(name, loader)``); a partial one builds its ``KernelOps`` with
``dataclasses.replace(get_ops("torch"), greedy_verify=...)``.

This package was ``kernels`` until 2026-12-05: transformers 5.25 requires Hugging Face's hub-kernels package, whose
import name is ``kernels``, and imports it with every model, so ours shadowed it from the repository root and no
model loaded. ``tests/specdec_kernels/test_transformers_compat.py`` checks that transformers loads a model with
ours importable. Importing this package imports neither torch nor triton.
"""

from __future__ import annotations

from typing import Callable

from specdec_kernels.ops import KernelOps

__all__ = ["KernelOps", "available_kernels", "get_ops", "register_ops"]


def _load_torch() -> KernelOps:
    from specdec_kernels.expand import expand_per_token_ref
    from specdec_kernels.greedy_verify import greedy_verify_ref
    from specdec_kernels.kv_compact import kv_compact_ref
    from specdec_kernels.output import create_output_ref, num_accepted_ref
    from specdec_kernels.rejection import rejection_accept_ref, sample_recovered_ref
    from specdec_kernels.sampling_filters import apply_min_p_ref, apply_temperature_ref, apply_top_k_top_p
    from specdec_kernels.tree import build_tree_mask_ref, tree_greedy_accept_ref
    from specdec_kernels.typical import typical_accept_ref

    return KernelOps(
        name="torch",
        greedy_verify=greedy_verify_ref,
        rejection_accept=rejection_accept_ref,
        sample_recovered=sample_recovered_ref,
        typical_accept=typical_accept_ref,
        num_accepted=num_accepted_ref,
        create_output=create_output_ref,
        expand_per_token=expand_per_token_ref,
        apply_temperature=apply_temperature_ref,
        apply_top_k_top_p=apply_top_k_top_p,  # fast torch path; tests compare it with _ref
        apply_min_p=apply_min_p_ref,
        build_tree_mask=build_tree_mask_ref,
        tree_greedy_accept=tree_greedy_accept_ref,
        kv_compact=kv_compact_ref,
    )


def _load_triton() -> KernelOps:
    try:  # picks the interpreter (no GPU) before anything decorates a kernel
        from specdec_kernels.triton_ops import load_triton_ops
    except ImportError as e:
        raise ValueError(f"kernel backend 'triton' needs the triton package ({e}); pip install triton, or "
                         f"use kernel='torch' for the reference ops.") from e
    return load_triton_ops()


_LOADERS: dict[str, Callable[[], KernelOps]] = {"torch": _load_torch, "triton": _load_triton}
_CACHE: dict[str, KernelOps] = {}


def available_kernels() -> list[str]:
    """Names ``get_ops`` accepts."""
    return sorted(_LOADERS)


def register_ops(name: str, loader: Callable[[], KernelOps], *, overwrite: bool = False) -> None:
    """Make ``get_ops(name)`` return ``loader()`` (called once, on first use)."""
    if name in _LOADERS and not overwrite:
        raise ValueError(f"kernel backend {name!r} is already registered; pass overwrite=True to replace it.")
    _LOADERS[name] = loader
    _CACHE.pop(name, None)


def get_ops(name: str = "torch") -> KernelOps:
    """The ops of backend ``name``; raises ValueError naming the known backends for an unknown one."""
    ops = _CACHE.get(name)
    if ops is None:
        if name not in _LOADERS:
            raise ValueError(f"unknown kernel backend {name!r}; known: {available_kernels()}. "
                             f"Register a new one with specdec_kernels.register_ops(name, loader).")
        ops = _CACHE[name] = _LOADERS[name]()
    return ops
