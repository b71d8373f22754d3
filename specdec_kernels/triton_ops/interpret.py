"""Where the Triton kernels run, settled once before any of them is decorated: on the GPU, or (no CUDA
device) in Triton's CPU interpreter, ``TRITON_INTERPRET=1``, logged once.

``@triton.jit`` decides at *decoration* time; ``specdec_kernels/triton_ops/__init__.py`` imports this module first,
so importing any op module of the package settles it. Knows nothing about the ops.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

__all__ = ["interpreted"]

log = logging.getLogger("specdec_kernels.triton")

if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before an op module's first @triton.jit (and triton's own, if we can)
    log.warning("triton kernels run interpreted on CPU (no GPU)")


def interpreted() -> bool:
    """True where the kernels run in Triton's CPU interpreter (no GPU, or TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _interpret_triton_stdlib() -> None:
    """Make triton's own ``@jit`` library (``tl.max``, ``tl.sum``, ``tl.argmax``, ...) interpretable.

    Those functions are decorated when ``triton.language`` is first imported; if that happened before
    ``TRITON_INTERPRET=1`` was set (someone imported triton before ``get_ops("triton")``), they are
    compile-only ``JITFunction`` objects that raise "Cannot call @triton.jit'd outside of the scope of a
    kernel" inside an interpreted kernel. Rebind each one, wherever triton exposes it, to an interpreted
    function over the same Python source (what decorating them under TRITON_INTERPRET=1 would have made).
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import triton.language as tl

    namespaces = [m for name, m in sys.modules.items() if m is not None and name.startswith("triton.language")]
    namespaces.append(tl.core.tensor)  # reductions bound as tensor methods (x.sum())
    rebuilt: dict[int, InterpretedFunction] = {}
    for ns in namespaces:
        for name, value in list(vars(ns).items()):
            if isinstance(value, JITFunction):
                setattr(ns, name, rebuilt.setdefault(id(value), InterpretedFunction(value.fn)))


if interpreted():
    _interpret_triton_stdlib()
