"""How long the int8 screen of experiments/bench/lm_screen.py takes beside the engine's bf16 LM head with its
statistics (``ops.linear_stats``), on the real head: a prototype kernel, not used by the engine.

    python -m experiments.bench.lm_screen_speed [--reps 15]

The screen (``lm_screen_vnni.cpp``, compiled here with the system's C++ compiler): int8 weights in groups of 64 along
K with one fp32 scale per output and group, x quantised to uint8 per row (zero point 128), int32 sums per group with
AVX512-VNNI's ``vpdpbusd`` (64 multiply-adds per instruction), then scale x sum summed over groups in fp32, for M rows
in blocks of 8. It measures the kernel's time only (no bounds, no candidate selection, no exact recompute: those
touch ~3 packed panels a row, see lm_screen.py). Every timed call follows a 300 MB read, so neither product finds its
weights in a cache, as in a forward. Needs a CPU with avx512_vnni (refused otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def build(out: Path) -> ctypes.CDLL:
    so = out / "lm_screen_vnni.so"
    cmd = ["g++", "-O3", "-march=x86-64-v4", "-mavx512vnni", "-fopenmp", "-shared", "-fPIC",
           str(HERE / "lm_screen_vnni.cpp"), "-o", str(so)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(so))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    from specdec.engine.bench import read_rate_gbs
    from specdec.engine.cpu import hugepages, ops
    from specdec.engine.cpu.build import cpu_flags
    from specdec.engine.loader import load_engine

    if "avx512_vnni" not in cpu_flags():
        raise SystemExit("lm_screen_speed: this CPU has no avx512_vnni (the prototype's vpdpbusd); run it on one that does")
    eng = load_engine("smollm2-135m-instruct", num_slots=1, max_model_len=512, dtype="auto")
    lm = eng._stack.lm_head
    W = lm.w.float()  # [V, K]
    V, K = W.shape
    G = 64
    Wg = W.view(V, K // G, G)
    s = Wg.abs().amax(-1, keepdim=True) / 127  # [V, K/G, 1]
    q = torch.round(Wg / s).clamp(-127, 127).to(torch.int8)  # [V, K/G, G]
    corr = (128 * q.to(torch.int32).sum(-1))  # [V, K/G]: what the zero point adds to each group's sum
    qp = hugepages.empty(V * K, torch.int8).view(V // 16, K // 4, 16, 4)  # 16 outputs x 4 consecutive k per vector
    qp.copy_(q.view(V // 16, 16, K // 4, 4).transpose(1, 2))
    scp = s.squeeze(-1).view(V // 16, 16, K // G).transpose(1, 2).contiguous()  # [V/16, K/G, 16]
    cpp = corr.view(V // 16, 16, K // G).transpose(1, 2).contiguous().to(torch.int32)
    del W, Wg, q
    big = hugepages.empty(300 << 18, torch.float32).fill_(1.0)  # 300 MB read between calls
    P = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        print(f"LM head [{V}, {K}]: bf16 {V * K * 2 / 1e6:.1f} MB, the int8 screen {V * K / 1e6:.1f} MB + scales")
        g = torch.Generator().manual_seed(0)
        for M in (1, 8):
            x = torch.randn(M, K, generator=g)
            xr = x.to(torch.bfloat16).float()
            sx = (xr.abs().amax(1) / 127.0).contiguous()
            xq = (torch.round(xr / sx[:, None]) + 128).to(torch.uint8).contiguous()
            out = torch.empty(M, V)
            tl, ts = [], []
            for _ in range(a.reps):  # interleaved
                big.sum()
                t = time.perf_counter()
                ops.linear_stats(x, lm)
                tl.append(time.perf_counter() - t)
                big.sum()
                t = time.perf_counter()
                lib.screen_vnni(P(qp), P(cpp), P(scp), ctypes.c_int64(V), ctypes.c_int64(K), ctypes.c_int64(G), P(xq),
                                P(sx), ctypes.c_int64(M), P(out))
                ts.append(time.perf_counter() - t)
            y = ops.linear_stats(x, lm)[0]
            err = float((y - out).abs().max())
            print(f"M={M}: bf16 linear_stats min {min(tl) * 1e3:.3f} ms, VNNI screen min {min(ts) * 1e3:.3f} ms "
                  f"({min(ts) / min(tl):.2f}x); largest |screen - exact| {err:.3f}")
    print(f"read rate {read_rate_gbs(300 << 20):.1f} GB/s")


if __name__ == "__main__":
    main()
