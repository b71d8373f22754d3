"""Launcher helpers shared by the Triton ops: argument checks (shape, dtype, one device) and tile sizes.

Tile sizes are the only compile-time constants derived from the data, and only from V (or another size
fixed for a model); B, k and the tree size stay runtime arguments (``do_not_specialize``), so a new batch
size or proposal length never compiles a new kernel (beyond the power-of-two tile buckets of small k).
"""

from __future__ import annotations

import torch
import triton

from specdec_kernels.triton_ops.interpret import interpreted

# Elements per tile (rows x columns [x radix]) a program holds at once: 4096 fp32 = 16 KiB over 4 warps
# stays in registers on an H100 without spilling (the budget of vLLM's v1 sampler kernels).
MAX_TILE = 4096
# V columns one program of a split row reduction covers (sample_recovered): at V = 128k this gives 16
# programs per row, so B = 64 already launches 1024 programs (H100: 132 SMs).
SPLIT_V = 8192
# Triton's CPU interpreter pays ~1 ms of Python per op and program whatever the tile size, so interpreted
# launches use much bigger tiles (fewer programs and V chunks; tests that shrink INTERPRETED_TILE run
# GPU-sized chunk loops instead).
INTERPRETED_TILE = 1 << 20

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def tile_elems() -> int:
    """Elements of one program's tile: MAX_TILE on a GPU, INTERPRETED_TILE under TRITON_INTERPRET=1."""
    return INTERPRETED_TILE if interpreted() else MAX_TILE


def row_tile(num_cols: int, num_rows: int, per_elem: int = 1) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_COLS) for a program that reduces over ``num_cols`` columns of several rows,
    holding ``per_elem`` values per element (a 3-D tile [rows, cols, per_elem])."""
    tile = tile_elems()
    block_cols = min(pow2(num_cols), max(1, tile // per_elem))
    return max(1, min(tile // (block_cols * per_elem), pow2(num_rows))), block_cols


def check_device(op: str, *tensors: torch.Tensor | None) -> torch.device:
    """The one device of ``tensors`` (None entries skipped); ValueError naming the op otherwise."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{op}: inputs are on several devices {sorted(map(str, devices))}; move them to "
                         f"one device (the Triton backend runs where its inputs are).")
    return devices.pop()


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected one of {[str(d) for d in allowed]}.")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    """``expected`` entries of None match any size."""
    ok = t.dim() == len(expected) and all(e is None or s == e for s, e in zip(t.shape, expected))
    if not ok:
        want = ", ".join("?" if e is None else str(e) for e in expected)
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected [{want}].")
