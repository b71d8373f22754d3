"""engine/matmul.py: every row-count path computes x @ W, and decode mode hands threads over and back."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.engine import matmul
from specdec.engine.matmul import SMALL_M, Weight, blas_forward, in_decode_mode, mm, release_threads, use_blas


@pytest.fixture(autouse=True)
def _restore():
    n, enabled = torch.get_num_threads(), matmul._state["enabled"]
    use_blas(True)
    yield
    release_threads()
    use_blas(enabled)
    torch.set_num_threads(n)


def _weight(n_in: int, n_out: int, bias: bool, seed: int = 0) -> Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_in, n_out, generator=g)
    return Weight.from_in_out(w, torch.randn(n_out, generator=g) if bias else None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 2, 5, SMALL_M, SMALL_M + 1])
@pytest.mark.parametrize("decode_mode", [False, True])
def test_mm_matches_reference_and_is_row_major(M, bias, decode_mode):
    wt = _weight(48, 80, bias)
    x = torch.randn(M, 48, generator=torch.Generator().manual_seed(1))
    if decode_mode:
        blas_forward(1, torch.float32, torch.device("cpu"))
        assert in_decode_mode()
    y = mm(x, wt)
    want = x.double() @ wt.w.double() + (0 if wt.bias is None else wt.bias.double())
    assert y.shape == (M, 80) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    # row-major result: a transposed one reached SDPA with a last-dim stride of M and took its slow math path
    assert y.stride() == (80, 1)


def test_one_row_takes_openblas_only_in_decode_mode(monkeypatch):
    wt = _weight(16, 8, False)
    calls = []
    real = torch.from_numpy
    monkeypatch.setattr(matmul.torch, "from_numpy", lambda a: calls.append(a.shape) or real(a))
    mm(torch.randn(1, 16), wt)
    assert calls == []  # outside decode mode: torch's MKL
    blas_forward(1, torch.float32, torch.device("cpu"))
    mm(torch.randn(1, 16), wt)
    assert calls == [(8,)]


def test_decode_mode_holds_torch_at_one_thread_until_a_multirow_forward():
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    blas_forward(1, torch.float32, cpu)
    assert in_decode_mode() and torch.get_num_threads() == 1
    blas_forward(1, torch.float32, cpu)  # sticky: still one thread, still remembers 2
    assert torch.get_num_threads() == 1
    blas_forward(5, torch.float32, cpu)  # a verification / prefill forward gets torch's threads back
    assert not in_decode_mode() and torch.get_num_threads() == 2
    blas_forward(1, torch.float32, cpu)
    release_threads()
    assert not in_decode_mode() and torch.get_num_threads() == 2
    release_threads()  # a no-op outside decode mode
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts OpenBLAS workers through Linux's /proc; needs 2 cores to have any")
def test_leaving_decode_mode_stops_openblas_workers():
    """Workers left spinning would steal a core from the next multi-row forward (matmul.py)."""
    torch.set_num_threads(2)
    wt = _weight(2048, 2048, bias=False)  # big enough for OpenBLAS to thread its sgemv
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    blas_forward(1, torch.float32, torch.device("cpu"))
    mm(torch.randn(1, 2048), wt)  # OpenBLAS sgemv on 2 threads: its worker is alive
    before = threads()
    release_threads()
    assert threads() < before
    blas_forward(1, torch.float32, torch.device("cpu"))  # and OpenBLAS starts them again on demand
    x = torch.randn(1, 2048)
    torch.testing.assert_close(mm(x, wt).double(), x.double() @ wt.w.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_never_enter_decode_mode(dtype):
    blas_forward(1, dtype, torch.device("cpu"))
    assert not in_decode_mode()
    wt = Weight.from_in_out(torch.randn(16, 8).to(dtype))
    assert wt.w_np is None
    assert mm(torch.randn(1, 16).to(dtype), wt).shape == (1, 8)


def test_use_blas_false_keeps_torch_everywhere():
    use_blas(False)
    blas_forward(1, torch.float32, torch.device("cpu"))
    assert not in_decode_mode()


def test_weight_shares_memory_between_layouts_for_a_tied_head():
    embed = torch.randn(100, 16)  # [V, D]
    wt = Weight.from_in_out(embed.t().contiguous(), w_t=embed)
    assert wt.w_t is embed and wt.w_np is not None
    assert wt.w_np.__array_interface__["data"][0] == embed.data_ptr()  # no third copy for NumPy


def test_engine_decode_leaves_torch_threads_as_found_after_generate():
    from specdec import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not in_decode_mode() and torch.get_num_threads() == 2


def test_greedy_tokens_do_not_depend_on_the_library():
    from specdec import LLM, SamplingParams

    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=96)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + 2 * i]} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    use_blas(False)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert fast == plain
