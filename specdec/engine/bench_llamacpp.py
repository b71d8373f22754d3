"""llama.cpp (through llama-cpp-python, the ``llamacpp`` extra) on the bench's cases: ``python -m
specdec.engine.bench --llamacpp`` runs it on the GGUF that ``gguf_export`` writes of our engine's own values
(float32 -> F32, bfloat16 -> BF16), at our thread count, timed with the bench's timer (min and median of ``reps``
after a warm-up): t(1) and v(M) = t(M) / t(1) for M new tokens after the prefix, logits for all M rows (what
verification reads), the M tokens removed from its KV cache after each rep; and the prefill of the prefix into an
empty cache (logits for the last row only, as ours). Its greedy token after the prefix is returned for the check that
both sides agree (same values -> same argmax).

The low-level API (``llama_decode`` on a ``llama_batch``, ``llama_memory_seq_rm``) because the high-level ``Llama``
neither asks for every row's logits per call nor cuts its cache back to a position. This module knows nothing about
our engine or the bench: it gets a GGUF path, the prefix, the cases and the timer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

INSTALL_HINT = ('llama.cpp comparison skipped: llama_cpp is not importable; install the extra with '
                'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e ".[llamacpp]" (builds llama.cpp, ~10 min on 2 cores)')


def available() -> str | None:
    """None when llama_cpp imports, else the one-line reason with the way to install it."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or an OSError from a broken shared library
        return INSTALL_HINT + ("" if isinstance(e, ModuleNotFoundError) else f" ({type(e).__name__}: {e})")
    return None


class _Runner:
    """One llama.cpp context on a GGUF: decode tokens at positions with chosen logits rows, cut the cache back."""

    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.ctx = self.llm.ctx
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
        if hasattr(llama_cpp, "llama_memory_seq_rm"):  # 0.3.10+: the KV cache is the context's "memory"
            mem = llama_cpp.llama_get_memory(self.ctx)
            self._rm = lambda p0: llama_cpp.llama_memory_seq_rm(mem, 0, p0, -1)
        elif hasattr(llama_cpp, "llama_kv_self_seq_rm"):
            self._rm = lambda p0: llama_cpp.llama_kv_self_seq_rm(self.ctx, 0, p0, -1)
        else:
            self._rm = lambda p0: llama_cpp.llama_kv_cache_seq_rm(self.ctx, 0, p0, -1)

    def cut(self, length: int) -> None:
        """Keep the first ``length`` positions of sequence 0."""
        if not self._rm(length):
            raise RuntimeError(f"llama.cpp: could not remove positions >= {length} from the KV cache")

    def decode(self, ids: list[int], start: int, all_logits: bool) -> None:
        """``ids`` at positions start.. of sequence 0; logits for every row, or only the last."""
        b, n = self.batch, len(ids)
        for i, t in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, start + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == n - 1
        b.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama.cpp: llama_decode returned {rc} for {n} tokens at position {start}")

    def last_argmax(self) -> int:
        """The argmax of the last decoded row's logits."""
        row = self.lc.llama_get_logits_ith(self.ctx, -1)
        return int(torch.frombuffer((self.lc.ctypes.c_float * self.n_vocab).from_address(
            self.lc.ctypes.addressof(row.contents)), dtype=torch.float32).argmax())

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.llm.close()


def bench_llamacpp(path: str, prefix: list[int], cases: Sequence[int], reps: int, threads: int,
                   time_ms: Callable[[Callable[[], None], int], tuple[float, float]]) -> dict:
    """-> {"M": {m: (min, med)}, "prefill": (min, med), "argmax": int} for llama.cpp on the GGUF at ``path``: M new
    random tokens (seeded as the bench's) after ``prefix`` for m in ``cases``, and the prefill of ``prefix``; each
    timed by ``time_ms(fn, reps)`` (the bench's timer)."""
    context = len(prefix)
    r = _Runner(path, n_ctx=context + 64, threads=threads)
    try:
        g = torch.Generator().manual_seed(0)

        def prefill():
            r.cut(0)
            r.decode(prefix, 0, all_logits=False)

        def step(m: int):
            def run():
                r.cut(context)
                r.decode(torch.randint(0, r.n_vocab, (m,), generator=g).tolist(), context, all_logits=True)

            return run

        pre = time_ms(prefill, reps)
        argmax = r.last_argmax()  # the prefill leaves the prefix in the cache, as the M cases need
        return {"M": {m: time_ms(step(m), reps) for m in cases}, "prefill": pre, "argmax": argmax}
    finally:
        r.close()


def comparison_table(ours: dict, theirs: dict, context: int) -> str:
    """The side-by-side table (markdown) of our rows and llama.cpp's: t(1), v(M), prefill, ours / llama.cpp."""
    t1, l1 = ours["M"][1][0], theirs["M"][1][0]
    rows = ["| case | ours ms (min / med) | llama.cpp ms (min / med) | ours v | llama.cpp v | ours / llama.cpp |",
            "|---|---|---|---|---|---|"]
    for m in theirs["M"]:
        (o, om), (t, tm) = ours["M"][m], theirs["M"][m]
        rows.append(f"| M={m} | {o:.2f} / {om:.2f} | {t:.2f} / {tm:.2f} | {o / t1:.2f} | {t / l1:.2f} | {o / t:.2f} |")
    (o, om), (t, tm) = ours["prefill"], theirs["prefill"]
    rows.append(f"| prefill {context} | {o:.2f} / {om:.2f} | {t:.2f} / {tm:.2f} | | | {o / t:.2f} |")
    same = "same" if ours["argmax"] == theirs["argmax"] else "DIFFERENT"
    rows.append(f"\ngreedy token after the {context}-token prefix: ours {ours['argmax']}, llama.cpp "
                f"{theirs['argmax']} ({same})")
    return "\n".join(rows)
