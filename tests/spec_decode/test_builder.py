"""build_spec_worker's refusal of a target that is not batch-invariant, and dtype='auto'."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.engine.loader import auto_dtype, load_engine
from specdec.spec_decode.builder import build_spec_worker, check_invariant


class _TorchPathEngine:  # what check_invariant reads of an engine on the torch reference path
    batch_invariant = False
    kernel_fallback_reason = "SPECDEC_NATIVE=0"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lossy_dtype_without_invariant_kernels_is_refused(dtype):
    with pytest.raises(ValueError, match=r"dtype=(bfloat16|float16) needs the batch-invariant native kernels.*SPECDEC_NATIVE=0"):
        check_invariant(_TorchPathEngine(dtype))


def test_fp32_torch_path_warns(caplog):
    with caplog.at_level(logging.WARNING):
        check_invariant(_TorchPathEngine(torch.float32))
    assert "not batch-invariant" in caplog.text


def test_refusal_comes_before_anything_is_built(monkeypatch):
    monkeypatch.setenv("SPECDEC_NATIVE", "0")
    target = load_engine("tiny-random-llama", num_slots=2, max_model_len=64, dtype="bfloat16")
    assert not target.batch_invariant and "SPECDEC_NATIVE=0" in target.describe()["kernels"]
    with pytest.raises(ValueError, match="needs the batch-invariant native kernels"):
        build_spec_worker(target, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=2, max_model_len=64)


def test_auto_dtype_follows_the_cpu():
    dt, why = auto_dtype()
    assert dt in (torch.float32, torch.bfloat16)
    assert why.startswith(str(dt).removeprefix("torch.") + ":")
    assert (dt == torch.bfloat16) == ("has AVX512_BF16" in why)
    engine = load_engine("tiny-random-llama", num_slots=1, max_model_len=16, dtype="auto")
    assert engine.dtype == dt
    info = engine.describe()
    assert info["dtype"] == str(dt).removeprefix("torch.") and info["cpu_capability"]
