"""Two builds of the CPU kernels side by side in one process: ``csrc/kernels.cpp`` of a git revision against
the working tree's, on the same engine, weights and KV cache.

    python -m experiments.bench.kernel_revs --rev HEAD~1 --threads 2 --context 512 --reps 9
    python -m experiments.bench.kernel_revs --source /tmp/variant.cpp ...   # an uncommitted variant as the baseline

One engine is loaded (its weights packed once); before each timed forward ``specdec.engine.cpu.ops`` is
pointed at one build or the other, alternating build by build within each repetition, so that drift of the
machine hits both alike. Both builds must pack weights alike (the same panel width), which is checked.
Prints, per M (new tokens after ``--context``, B = 1), per B (one-token decode) and for ``--prefill``, the min
over ``--reps`` for each build, their ratio and whether the two builds' logits were bit-identical (both run the same
tokens in each repetition: a change meant to regroup work only must say yes), beside the machine's read rate (``W.sum()``) for the weights'
bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.engine.bench import B_CASES, M_CASES, read_rate_gbs, setup, weight_bytes
from specdec.engine.cpu import build, ops
from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]


def build_rev(rev: str, out_dir: Path, source: Path | None = None) -> ctypes.CDLL:
    """Compile kernels.cpp as it is at ``rev`` (or the file ``source``) for this CPU's ISA -> the loaded
    library (signatures declared)."""
    rel = build.SOURCE.relative_to(ROOT)
    if source is not None:
        if not source.is_file():
            raise SystemExit(f"--source {str(source)!r}: no such file; give a copy of {rel} to compare against")
        text = source.read_text()
    else:
        src = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        if src.returncode:
            raise SystemExit(f"--rev {rev!r}: git show failed: {src.stderr.strip()}; give a revision that has {rel}")
        text = src.stdout
    # the headers kernels.cpp includes (csrc/*.h): the revision's own, else (a --source file) the file's folder
    # first, then the working tree's
    inc = [out_dir]
    if source is None:
        heads = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{rel.parent}/"], cwd=ROOT,
                               capture_output=True, text=True).stdout.split()
        for h in (h for h in heads if h.endswith(".h")):
            (out_dir / Path(h).name).write_text(subprocess.run(["git", "show", f"{rev}:{h}"], cwd=ROOT,
                                                               capture_output=True, text=True, check=True).stdout)
    else:
        inc = [source.resolve().parent, build.SOURCE.parent]
    path = out_dir / "kernels_rev.cpp"
    path.write_text(text)
    so = out_dir / "kernels_rev.so"
    flags = build.BASE_FLAGS + build.ISAS[build.choose_isa()] + [f"-I{d}" for d in inc]
    subprocess.run([build._compiler() or "g++", *flags, str(path), "-o", str(so)], check=True)
    return ops.declare(ctypes.CDLL(str(so)))


def same_packing(a: ctypes.CDLL, b: ctypes.CDLL) -> bool:
    w = torch.randn(100, 64)
    n = a.sd_pack(0, w.data_ptr(), 100, 64, None)
    if n != b.sd_pack(0, w.data_ptr(), 100, 64, None) or a.sd_vl() != b.sd_vl():
        return False
    pa, pb = torch.empty(n), torch.empty(n)
    a.sd_pack(0, w.data_ptr(), 100, 64, pa.data_ptr())
    b.sd_pack(0, w.data_ptr(), 100, 64, pb.data_ptr())
    return torch.equal(pa, pb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="git revision whose kernels.cpp is the baseline")
    ap.add_argument("--source", type=Path, default=None,
                    help="a kernels.cpp file to be the baseline instead of --rev's (an uncommitted variant)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also time a prefill of one empty slot x N tokens (P1: a prompt's time to first token) and "
                         "of 7 (P: as the distillation prefill runs); N <= context + 64")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    new = ops.lib()
    if new is None:
        raise SystemExit(f"native kernels unavailable ({build.status()})")
    with tempfile.TemporaryDirectory() as tmp:
        old = build_rev(a.rev, Path(tmp), a.source)
        base = str(a.source) if a.source is not None else a.rev
        if not same_packing(old, new):
            raise SystemExit(f"{base}: its kernels pack weights differently; the engine's packed weights "
                             "cannot serve both builds, so compare with two separate runs of specdec.engine.bench")
        builds = {base: old, "working tree": new}
        eng, slots, lens, g = setup(a.model, a.context, a.dtype)  # the cases of specdec.engine.bench

        def once(batch_slots: list[int], ids: torch.Tensor, q: int, fresh: bool) -> tuple[float, torch.Tensor]:
            for s in batch_slots:
                eng.rollback(s, 0 if fresh else lens[s])
            t = time.perf_counter()
            last = torch.arange(1, len(batch_slots) + 1) * q - 1 if fresh else None  # a prompt: its last row's logits
            out = eng.forward(ForwardBatch(ids, batch_slots, [q] * len(batch_slots), logits_indices=last))
            return (time.perf_counter() - t) * 1e3, out.logits

        def case(batch_slots: list[int], q: int, fresh: bool = False) -> tuple[dict[str, float], bool]:
            """-> (each build's fastest ms, whether the builds' logits were bit-identical in every repetition)"""
            best = dict.fromkeys(builds, float("inf"))
            same = True
            for r in range(a.reps + 1):  # the first repetition warms up
                ids = torch.randint(0, eng.vocab_size, (len(batch_slots) * q,), generator=g)  # [B * q]
                outs = []
                for name, so in builds.items():
                    ops._lib[:] = [so]
                    t, logits = once(batch_slots, ids, q, fresh)
                    outs.append(logits)
                    if r:
                        best[name] = min(best[name], t)
                same = same and torch.equal(outs[0], outs[1])
            ops._lib[:] = [new]
            return best, same

        nbytes = weight_bytes(eng)
        rate = read_rate_gbs(nbytes if a.dtype == "float32" else 2 * nbytes)
        print(f"model={a.model} dtype={a.dtype} threads={torch.get_num_threads()} context={a.context} "
              f"isa={build.choose_isa()} reps={a.reps}; read rate {rate:.1f} GB/s, {nbytes / 1e6:.0f} MB of "
              f"weights = {nbytes / rate / 1e6:.2f} ms per forward at that rate")
        print(f"  {'case':>6} | {base + ' ms':>14} | {'working tree ms':>15} | ratio | same logits")
        rows = [("M", m, [slots[8]], m) for m in M_CASES] + [("B", b, slots[:b], 1) for b in B_CASES]
        if a.prefill:  # last: they overwrite the prefixes of slots 9..15
            rows.append(("P1", a.prefill, slots[9:10], a.prefill))  # one prompt (time to first token)
            rows.append(("P", a.prefill, slots[9:16], a.prefill))
        t1 = {}
        for key, c, bs, q in rows:
            best, same = case(bs, q, fresh=key.startswith("P"))
            if key == "M" and c == 1:
                t1 = best
            vs = "  ".join(f"v={best[n] / t1[n]:.2f}" for n in builds) if key == "M" else ""
            if key.startswith("P"):
                vs = "  ".join(f"{len(bs) * c / best[n] * 1e3:.0f} tok/s" for n in builds)
            print(f"  {key}={c:<4} | {best[base]:14.2f} | {best['working tree']:15.2f} | "
                  f"{best['working tree'] / best[base]:.2f} | {'yes' if same else 'NO'}  {vs}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
