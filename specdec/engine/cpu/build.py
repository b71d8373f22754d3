"""Compile ``csrc/kernels.cpp`` once per machine and load it: ``python -m specdec.engine.cpu.build``.

A plain shared library (no torch headers, no pybind), built by the system's ``g++`` in ~2 s and called
through ctypes with raw pointers, so building needs no Python-extension toolchain and a first run waits
seconds, not the ~1 min a ``torch.utils.cpp_extension`` build of torch's headers takes. The build is
cached under ``$SPECDEC_CACHE/cpu_kernels/`` keyed by the sources (every file in ``csrc/``: kernels.cpp includes
draft_tree.h), the flags and the compiler, so a second run only loads it. ``scripts/install.sh`` builds it ahead.

Which build, from the CPU's flags at run time (``/proc/cpuinfo``): ``amx`` (x86-64-v4 + AVX512_BF16 + AMX: bf16
products in tiles; falls back to ``avx512bf16`` where Linux refuses the tile state), ``avx512bf16`` (x86-64-v4 +
AVX512_BF16: vdpbf16ps for bf16 weights), ``avx2`` (x86-64-v3: AVX2, FMA, F16C) or ``generic`` (portable C++).
``SPECDEC_CPU_ISA`` forces one (tests build the others on the same box). ``SPECDEC_NATIVE=0`` skips the
library: the engine then runs its torch reference path (``specdec/engine/llama.py``).

This module knows nothing about models: it hands back a ``ctypes.CDLL`` or the reason there is none.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: the library then binds to torch's libgomp, one thread pool)

from specdec.engine.paths import cache_root

__all__ = ["BF16_ISAS", "ISAS", "cpu_flags", "choose_isa", "load", "status"]

SOURCE = Path(__file__).with_name("csrc") / "kernels.cpp"
ISAS = {
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "avx512bf16": ["-march=x86-64-v4", "-mavx512bf16"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}
# the builds whose bf16 products round x to bf16 and multiply in bf16 (vdpbf16ps or AMX tiles); the others widen W
BF16_ISAS = ("amx", "avx512bf16")
# -ffp-contract=off: the only fused multiply-adds are the ones the source writes, so the arithmetic of a
# row is what kernels.cpp says, whatever the optimiser sees around it.
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo spells them (empty where there is no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_isa(flags: set[str] | None = None) -> str:
    forced = os.environ.get("SPECDEC_CPU_ISA")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"SPECDEC_CPU_ISA={forced!r}; use one of {', '.join(ISAS)} or unset it")
        return forced
    f = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16"} <= f:
        return "amx" if {"amx_tile", "amx_bf16"} <= f else "avx512bf16"
    if {"avx2", "fma", "f16c", "bmi2", "movbe"} <= f:
        return "avx2"
    return "generic"


def _cache_dir() -> Path:
    return cache_root() / "cpu_kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(isa: str, cxx: str) -> Path:
    flags = BASE_FLAGS + ISAS[isa]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    sources = b"".join(f.read_bytes() for f in sorted(SOURCE.parent.glob("*.[ch]*")))  # kernels.cpp and what it includes
    key = hashlib.sha1(sources + " ".join(flags + version).encode()).hexdigest()[:16]
    out = _cache_dir() / f"kernels-{isa}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed on {SOURCE} ({isa}):\n{r.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(isa: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(library, description) for ``isa`` (default: the CPU's); (None, why) when it cannot be had."""
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return None, "SPECDEC_NATIVE=0"
    isa = isa or choose_isa()
    if isa in _loaded:
        return _loaded[isa]
    cxx = _compiler()
    if cxx is None:
        res: tuple[ctypes.CDLL | None, str] = (None, "no C++ compiler (g++) on PATH; install one or set CXX")
    else:
        try:
            lib = ctypes.CDLL(str(_build(isa, cxx)))
            lib.sd_ready.restype = ctypes.c_int
            res = (lib, f"native {isa}")
            if not lib.sd_ready():  # the amx build where Linux refuses the tile state (an old kernel)
                lib, why = load("avx512bf16")
                res = (lib, f"{why} (the OS refused AMX's tile state)")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            res = (None, f"native kernels unavailable: {e}")
    _loaded[isa] = res
    return res


def status() -> str:
    """One line for summaries and logs: which kernels and why."""
    return load()[1]


if __name__ == "__main__":
    lib, why = load()
    print(f"specdec CPU kernels: {why}")
    sys.exit(0 if lib is not None or os.environ.get("SPECDEC_NATIVE") == "0" else 1)
