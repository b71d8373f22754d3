"""Time one engine forward: ``python -m specdec.engine.bench [--model M] [--threads N] [--context L]``.

Prints the min and median ms of: B=1 decode (1 new token), B=1 with 8 new tokens (a k=7 verification), and B=8
decode on contiguous and on scattered slots (ragged lengths), each after a ~``--context``-token prefix.
On a shared machine take the median of several runs; other processes add noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import DEFAULT_MODEL, load_engine


def _time_ms(fn, reps: int) -> tuple[float, float]:
    """(min, median) ms over reps calls after a warm-up; the min is the figure least hurt by other
    processes on a shared machine, the median the typical one."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), statistics.median(times)


def bench(model: str = DEFAULT_MODEL, context: int = 128, reps: int = 20, dtype: str = "float32"):
    """-> {case: (min ms, median ms)}."""
    eng = load_engine(model, num_slots=16, max_model_len=context + 64, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    slots = [eng.allocate_slot() for _ in range(16)]
    for i, s in enumerate(slots):  # ragged prefixes: context - 8 .. context + 7
        n = context - 8 + i
        ids = torch.randint(0, eng.vocab_size, (n,), generator=g)
        eng.forward(ForwardBatch(ids, [s], [n], logits_indices=torch.tensor([n - 1])))
    lens = {s: eng.seq_len(s) for s in slots}

    def step(batch_slots: list[int], q: int):
        def run():
            for s in batch_slots:
                eng.rollback(s, lens[s])
            ids = torch.randint(0, eng.vocab_size, (len(batch_slots) * q,), generator=g)
            eng.forward(ForwardBatch(ids, batch_slots, [q] * len(batch_slots)))

        return run

    return {
        "B=1 decode": _time_ms(step([0], 1), reps),
        "B=1 8 tokens": _time_ms(step([0], 8), reps),
        "B=8 decode, slots 0-7": _time_ms(step(slots[:8], 1), reps),
        "B=8 decode, odd slots": _time_ms(step(slots[1::2], 1), reps),
    }


def bench_transformers(model: str = DEFAULT_MODEL, context: int = 128, reps: int = 20) -> dict[str, tuple[float, float]]:
    """The same B=1 figures for transformers' forward with its DynamicCache, as the reference."""
    from transformers import AutoModelForCausalLM

    from specdec.engine.loader import resolve_model_dir

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(model)), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = hf(torch.randint(0, hf.config.vocab_size, (1, context), generator=g), use_cache=True).past_key_values

        def step(q: int):
            def run():
                hf(torch.randint(0, hf.config.vocab_size, (1, q), generator=g), past_key_values=cache, use_cache=True)
                cache.crop(-q)  # transformers 5: a negative count removes that many tokens

            return run

        return {"B=1 decode": _time_ms(step(1), reps), "B=1 8 tokens": _time_ms(step(8), reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' forward (B=1)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"model={a.model} threads={torch.get_num_threads()} context={a.context} dtype={a.dtype}")
    for name, (lo, med) in bench(a.model, a.context, a.reps, a.dtype).items():
        print(f"{name:>22}: min {lo:7.2f} ms   median {med:7.2f} ms")
    if a.transformers:
        for name, (lo, med) in bench_transformers(a.model, a.context, a.reps).items():
            print(f"{'hf ' + name:>22}: min {lo:7.2f} ms   median {med:7.2f} ms")


if __name__ == "__main__":
    main()
