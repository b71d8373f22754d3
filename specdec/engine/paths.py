"""Where specdec keeps what it builds or converts once per machine: ``$SPECDEC_CACHE``, default
``~/.cache/specdec`` (converted models beside ``cpu_kernels/``).

The bottom of the engine's imports: the loader and the kernel builder both read it, so it imports
nothing of specdec.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")
