"""Triton kernels for the ops of :mod:`kernels`, one module per op, named after its torch reference:
``specdec_kernels/triton_ops/rejection.py`` holds the ``@triton.jit`` kernels and their launchers for the
references in ``specdec_kernels/rejection.py``, with the same signatures (kernel -> launcher, reference beside).

They live apart from the references because ``@triton.jit`` decides at *decoration* time whether a kernel
is compiled for a GPU or run by Triton's CPU interpreter: importing this package first settles that
(no CUDA device -> ``TRITON_INTERPRET=1``, logged once), so every launcher below runs on CPU tensors too.
Only ``specdec_kernels.get_ops("triton")`` (or a test) imports this package; ``import specdec_kernels`` never does.
"""

from __future__ import annotations

from specdec_kernels.triton_ops.interpret import interpreted  # first: settles GPU vs interpreter before any @triton.jit

__all__ = ["interpreted", "load_triton_ops"]


def load_triton_ops():
    """The ``KernelOps`` of every Triton launcher (the loader behind ``get_ops("triton")``)."""
    from specdec_kernels.ops import KernelOps
    from specdec_kernels.triton_ops.expand import expand_per_token
    from specdec_kernels.triton_ops.greedy_verify import greedy_verify
    from specdec_kernels.triton_ops.kv_compact import kv_compact
    from specdec_kernels.triton_ops.output import create_output, num_accepted
    from specdec_kernels.triton_ops.rejection import rejection_accept, sample_recovered
    from specdec_kernels.triton_ops.sampling_filters import apply_min_p, apply_temperature, apply_top_k_top_p
    from specdec_kernels.triton_ops.tree import build_tree_mask, tree_greedy_accept
    from specdec_kernels.triton_ops.typical import typical_accept

    return KernelOps(
        name="triton",
        greedy_verify=greedy_verify,
        rejection_accept=rejection_accept,
        sample_recovered=sample_recovered,
        typical_accept=typical_accept,
        num_accepted=num_accepted,
        create_output=create_output,
        expand_per_token=expand_per_token,
        apply_temperature=apply_temperature,
        apply_top_k_top_p=apply_top_k_top_p,
        apply_min_p=apply_min_p,
        build_tree_mask=build_tree_mask,
        tree_greedy_accept=tree_greedy_accept,
        kv_compact=kv_compact,
    )
