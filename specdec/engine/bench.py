"""Time the engine's forward beside its memory-bandwidth limit: ``python -m specdec.engine.bench``.

In one run, for each ``--dtype``:
- the machine's read rate: ``W.sum()`` over a buffer as large as the weights a forward reads (the
  fastest a kernel streams them here), and so the one-token limit ``t*(1) = bytes / rate``;
- B=1 forwards of M new tokens after a ``--context`` prefix, M in {1, 2, 3, 5, 9, 17, 33}: time, v(M) =
  t(M) / t(1) and the weights' effective read rate;
- one-token decode at B in {1, 4, 8, 16} (ragged contexts around ``--context``), and t(B) / t(1);
- a roofline per M: the time beside the bytes-bound time (weights / read rate) and the flops-bound time (2 M params /
  the fp32 GEMM rate torch measures here), and which one binds;
- the prefill of ``--context`` tokens into an empty slot (logits for its last row);
- with ``--transformers``, transformers' forward (DynamicCache, same weights, fp32) on the same cases;
- with ``--llamacpp`` (the ``llamacpp`` extra), llama.cpp on a GGUF of the same values (F32 for float32, BF16 for
  bfloat16) at the same thread count: t(1), v(M) and prefill beside ours, and both greedy tokens after the prefix
  (``bench_llamacpp.py``);
- with ``--memory``, only the RSS a loaded engine adds beside its packed weights' bytes.

Min and median of ``--reps`` calls after a warm-up; the min is the figure least hurt by other processes.
Figures from different runs are not comparable (machines differ up to 3x): compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.engine.cpu import hugepages
from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import DEFAULT_MODEL, load_engine

M_CASES = (1, 2, 3, 5, 7, 9, 17, 33)  # 7: the default EAGLE tree (3 x 3 x 6) plus its root
B_CASES = (1, 4, 8, 16)


def _time_ms(fn, reps: int) -> tuple[float, float]:
    """(min, median) ms over reps calls after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), statistics.median(times)


def weight_bytes(engine) -> int:
    """Bytes of weights one forward reads: every layer's projections and the LM head (from the shapes: nothing is
    unpacked)."""
    c = engine.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (q + 2 * kv) * c.hidden_size + q * c.hidden_size + 3 * c.intermediate_size * c.hidden_size
    n = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    return n * torch.empty(0, dtype=engine.dtype).element_size()


def rss_bytes() -> int:
    """This process's resident set (VmRSS of /proc/self/status), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("rss_bytes: no VmRSS in /proc/self/status (Linux only)")


def memory(model: str = DEFAULT_MODEL, dtype: str = "float32") -> dict:
    """RSS before and after loading ``model`` (one slot, a 256-token cache) beside its weights' bytes: the packed
    copies the kernels read (the only copies kept, #43 item 5) and the plain [out, in] bytes."""
    import gc

    before = rss_bytes()
    eng = load_engine(model, num_slots=1, max_model_len=256, dtype=dtype)
    gc.collect()
    after = rss_bytes()
    packed = eng.packed_weight_bytes()
    return {"rss_before": before, "rss_after": after, "loaded": after - before, "packed": packed,
            "plain": weight_bytes(eng), "kernels": eng.describe()["kernels"], "dtype": eng.describe()["dtype"]}


def roof_dtype(dtype: str) -> torch.dtype:
    """The arithmetic a product over ``dtype`` weights runs in here: bf16 where the CPU has bf16 arithmetic (our
    vdpbf16ps and AMX builds), else fp32 (bf16 and fp16 are widened)."""
    from specdec.engine.cpu.build import BF16_ISAS, choose_isa

    return torch.bfloat16 if dtype == "bfloat16" and choose_isa() in BF16_ISAS else torch.float32


def gemm_gflops(dtype: str = "float32", n: int = 2048, reps: int = 3) -> float:
    """GFLOP/s of torch's GEMM on [n, n] matrices (best of ``reps`` after a warm-up): the compute roof the roofline
    uses, a measured rate rather than a datasheet's peak. bf16 takes torch's bf16 GEMM where the CPU has bf16
    arithmetic (oneDNN's vdpbf16ps / AMX: 418 GFLOP/s on a 2-core Zen 4 where fp32 reaches 152), otherwise, as fp16
    (both widened to fp32 in our kernels), the fp32 GEMM."""
    dt = roof_dtype(dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def roofline(res: dict, rate_gbs: float, gflops: float) -> list[tuple[int, float, float, float, str]]:
    """Per M: (M, measured min ms, bytes-bound ms = weight bytes / read rate, flops-bound ms = 2 M params / the
    GEMM rate, which binds). Attention's reads and flops are left out (small beside the weights' at these
    contexts)."""
    out = []
    for m, (lo, _) in res["M"].items():
        tb, tf = res["bytes"] / rate_gbs / 1e6, 2 * m * res["params"] / gflops / 1e6
        out.append((m, lo, tb, tf, "bytes" if tb >= tf else "flops"))
    return out


def read_rate_gbs(nbytes: int, reps: int = 5) -> float:
    """GB/s of ``W.sum()`` over ``nbytes`` of fp32: the machine's streaming read rate, over memory of the pages the
    packed weights sit on (huge pages where offered: specdec/engine/cpu/hugepages.py), so that the bytes-bound time
    is the one those weights could reach."""
    w = hugepages.empty(nbytes // 4, torch.float32).fill_(1.0)
    w.sum()
    t = time.perf_counter()
    for _ in range(reps):
        w.sum()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def setup(model: str, context: int, dtype: str):
    """An engine with 16 slots holding ragged random prefixes (context - 8 .. context + 7; slot 8 holds
    exactly ``context``) -> (engine, slots, {slot: prefix length}, the generator the cases draw ids from)."""
    eng = load_engine(model, num_slots=16, max_model_len=context + 64, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    slots = [eng.allocate_slot() for _ in range(16)]
    for i, s in enumerate(slots):
        n = context - 8 + i
        ids = torch.randint(0, eng.vocab_size, (n,), generator=g)
        eng.forward(ForwardBatch(ids, [s], [n], logits_indices=torch.tensor([n - 1])))
    return eng, slots, {s: eng.seq_len(s) for s in slots}, g


def prefix_ids(vocab_size: int, context: int) -> torch.Tensor:
    """[context] int64: the prefix the prefill case feeds and after which both engines' greedy token is compared."""
    return torch.randint(0, vocab_size, (context,), generator=torch.Generator().manual_seed(1))


def bench(model: str = DEFAULT_MODEL, context: int = 512, reps: int = 10, dtype: str = "float32") -> dict:
    """-> {"M": {m: (min, med)}, "B": {b: (min, med)}, "prefill": (min, med) of ``context`` tokens into an empty
    slot, "argmax": the greedy token after ``prefix_ids``, "bytes": int, "params": int, "kernels": str}."""
    eng, slots, lens, g = setup(model, context, dtype)
    prefix, last = prefix_ids(eng.vocab_size, context), {}

    def prefill():
        eng.rollback(slots[8], 0)
        out = eng.forward(ForwardBatch(prefix, [slots[8]], [context], logits_indices=torch.tensor([context - 1])))
        last["logits"] = out.logits

    def step(batch_slots: list[int], q: int):
        def run():
            for s in batch_slots:
                eng.rollback(s, lens[s])
            ids = torch.randint(0, eng.vocab_size, (len(batch_slots) * q,), generator=g)
            eng.forward(ForwardBatch(ids, batch_slots, [q] * len(batch_slots)))  # logits for every row

        return run

    return {
        "M": {m: _time_ms(step([slots[8]], m), reps) for m in M_CASES},  # slot 8: context exactly
        "B": {b: _time_ms(step(slots[:b], 1), reps) for b in B_CASES},
        "prefill": _time_ms(prefill, reps),  # last: it leaves slot 8 holding the prefix, at the same length
        "argmax": int(last["logits"][0].argmax()),
        "bytes": weight_bytes(eng),
        "params": weight_bytes(eng) // torch.empty(0, dtype=eng.dtype).element_size(),
        "kernels": eng.describe()["kernels"],
    }


def bench_llamacpp(model: str = DEFAULT_MODEL, context: int = 512, reps: int = 10, dtype: str = "float32",
                   threads: int | None = None) -> dict:
    """The M cases and the prefill for llama.cpp on the GGUF of ``model``'s ``dtype`` values (written once by
    gguf_export), at ``threads`` (default: ours) -> bench_llamacpp.bench_llamacpp's dict plus "gguf" (the path) and
    "type" ("F32" | "BF16"). Raises ValueError for a model with no GGUF source or a dtype with no GGUF type."""
    from specdec.engine import bench_llamacpp as lcb
    from specdec.engine.gguf_export import GGUF_TYPES, exported_gguf
    from specdec.engine.loader import model_info

    dt = getattr(torch, dtype)
    path = exported_gguf(model, dt)
    prefix = prefix_ids(model_info(model).vocab_size, context).tolist()
    res = lcb.bench_llamacpp(str(path), prefix, M_CASES, reps, threads or torch.get_num_threads(), _time_ms)
    return res | {"gguf": str(path), "type": GGUF_TYPES[dt]}


def bench_transformers(model: str = DEFAULT_MODEL, context: int = 512, reps: int = 10) -> dict:
    """The same cases for transformers' forward with its DynamicCache (fp32), as the reference."""
    from transformers import AutoModelForCausalLM

    from specdec.engine.loader import resolve_model_dir

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(model)), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    V = hf.config.vocab_size
    out: dict = {"M": {}, "B": {}}
    with torch.inference_mode():
        for key, cases in (("M", M_CASES), ("B", B_CASES)):
            for c in cases:
                b, q = (1, c) if key == "M" else (c, 1)
                cache = hf(torch.randint(0, V, (b, context), generator=g), use_cache=True).past_key_values

                def run(b=b, q=q, cache=cache):
                    hf(torch.randint(0, V, (b, q), generator=g), past_key_values=cache, use_cache=True)
                    cache.crop(-q)  # transformers 5: a negative count removes that many tokens

                out[key][c] = _time_ms(run, reps)
    return out


def _table(res: dict, rate: float, label: str, gflops: float = 0.0, roof: str = "fp32") -> None:
    t1 = res["M"][1][0]
    nbytes = res.get("bytes")
    print(f"  {label}: B=1, M new tokens after the context")
    for m, (lo, med) in res["M"].items():
        gbs = f"  weights read at {nbytes / lo / 1e6:5.1f} GB/s" if nbytes else ""
        print(f"    M={m:2d}: min {lo:7.2f} ms  median {med:7.2f} ms  v={lo / t1:5.2f}{gbs}")
    print(f"  {label}: one-token decode at batch B")
    for b, (lo, med) in res["B"].items():
        print(f"    B={b:2d}: min {lo:7.2f} ms  median {med:7.2f} ms  t(B)/t(1)={lo / res['B'][1][0]:5.2f}")
    if nbytes:
        print(f"    limit: {nbytes / 1e6:.0f} MB of weights at the read rate {rate:.1f} GB/s = {nbytes / rate / 1e6:.2f} ms"
              f" per forward; t(1) is {t1 / (nbytes / rate / 1e6):.2f}x that")
    if "prefill" in res:
        lo, med = res["prefill"]
        print(f"  {label}: prefill of the context into an empty slot: min {lo:7.2f} ms  median {med:7.2f} ms")
    if nbytes and gflops:
        print(f"  {label}: roofline (read rate {rate:.1f} GB/s, torch's {roof} GEMM {gflops:.0f} GFLOP/s measured)")
        for m, lo, tb, tf, bound in roofline(res, rate, gflops):
            print(f"    M={m:2d}: {lo:7.2f} ms  bytes-bound {tb:6.2f} ms  flops-bound {tf:6.2f} ms  {bound} bind: "
                  f"{lo / max(tb, tf):4.2f}x the bound")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="float32", help="comma-separated, e.g. float32,bfloat16")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' forward (fp32)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also time llama.cpp on a GGUF of the same values (needs the llamacpp extra)")
    ap.add_argument("--memory", action="store_true", help="only the RSS of a loaded engine against its weights' bytes")
    a = ap.parse_args()
    if a.memory:
        for dt in a.dtype.split(","):
            r = memory(a.model, dt)
            print(f"{a.model} {r['dtype']} [{r['kernels']}]: RSS {r['rss_before'] / 1e6:.0f} MB before loading, "
                  f"{r['rss_after'] / 1e6:.0f} MB after (+{r['loaded'] / 1e6:.0f} MB); packed weights "
                  f"{r['packed'] / 1e6:.0f} MB (plain {r['plain'] / 1e6:.0f} MB): loaded / packed = "
                  f"{r['loaded'] / max(r['packed'], 1):.2f}, RSS / packed = {r['rss_after'] / max(r['packed'], 1):.2f}")
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"model={a.model} threads={torch.get_num_threads()} context={a.context} "
          f"cpu_capability={torch.backends.cpu.get_cpu_capability()}")
    llamacpp = a.llamacpp
    if llamacpp:
        from specdec.engine import bench_llamacpp as lcb

        if (why := lcb.available()) is not None:
            print(why)
            llamacpp = False
    for dt in a.dtype.split(","):
        res = bench(a.model, a.context, a.reps, dt)
        rate = read_rate_gbs(res["bytes"] if dt == "float32" else 2 * res["bytes"])
        roof = "bf16" if roof_dtype(dt) == torch.bfloat16 else "fp32"
        _table(res, rate, f"ours {dt} [{res['kernels']}]", gemm_gflops(dt), roof)
        if llamacpp:
            try:
                lc = bench_llamacpp(a.model, a.context, a.reps, dt)
            except ValueError as e:  # a model with no GGUF source, a dtype with no GGUF type
                print(f"llama.cpp comparison skipped for {dt}: {e}")
                continue
            print(f"\n### ours {dt} vs llama.cpp {lc['type']} ({lc['gguf']}, {torch.get_num_threads()} threads, "
                  f"context {a.context})\n")
            print(lcb.comparison_table(res, lc, a.context) + "\n")
    if a.transformers:
        _table(bench_transformers(a.model, a.context, a.reps), 0.0, "transformers float32")


if __name__ == "__main__":
    main()
