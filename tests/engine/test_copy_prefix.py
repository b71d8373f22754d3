"""ModelEngine.copy_prefix: a slot given another slot's prefix computes exactly what a fresh prefill would.

Both NativeEngine paths: float32 and bfloat16 run the CPU kernels (their blocked K copy ``kt``, and a bf16 model's
bf16 V copy ``vh``, valid up to ``kt_valid``, must follow the cache), float64 the torch reference (SlotKVCache
alone)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.testing import rand_tokens, run
from specdec.engine.tiny import tiny_random_llama

DTYPES = [torch.float32, torch.bfloat16, torch.float64]  # kernels (when built; bf16: their bf16 K/V copies) / torch


@pytest.fixture(params=DTYPES, ids=["kernels", "kernels-bf16", "torch"])
def engine(request):
    eng = tiny_random_llama(0, num_slots=4, max_model_len=64, dtype=request.param)
    if request.param == torch.float64:
        assert not eng.batch_invariant  # the torch path really runs
    return eng


@pytest.mark.parametrize("length", [13, 8, 0])
def test_copied_prefix_equals_fresh_prefill_bitwise(engine, length):
    prompt, cont = rand_tokens(13, 1), rand_tokens(4, 2)
    src = engine.allocate_slot()
    run(engine, {src: prompt})
    run(engine, {src: rand_tokens(3, 3)})  # src holds more than the prefix (and its keys are all blocked)
    dst = engine.allocate_slot()
    run(engine, {dst: rand_tokens(20, 4)})  # stale, longer content that the copy must replace
    engine.copy_prefix(src, dst, length)
    assert engine.seq_len(dst) == length and engine.seq_len(src) == 16
    got = [run(engine, {dst: [t]}).logits for t in cont]
    fresh = engine.allocate_slot()
    if length:
        run(engine, {fresh: prompt[:length]})
    ref = [run(engine, {fresh: [t]}).logits for t in cont]
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    # the source is untouched: it continues as if nothing happened
    engine.rollback(src, 13)
    engine.rollback(fresh, 0)
    run(engine, {fresh: prompt})
    assert torch.equal(run(engine, {src: [cont[0]]}).logits, run(engine, {fresh: [cont[0]]}).logits)


def test_copy_after_rollback_of_source(engine):
    """src rolled back below what its blocked keys held: dst must not trust keys past the rollback."""
    prompt = rand_tokens(10, 5)
    src, dst, fresh = engine.allocate_slot(), engine.allocate_slot(), engine.allocate_slot()
    run(engine, {src: prompt + rand_tokens(6, 6)})
    engine.rollback(src, 10)
    engine.copy_prefix(src, dst, 10)
    run(engine, {fresh: prompt})
    nxt = rand_tokens(3, 7)
    assert torch.equal(run(engine, {dst: nxt}).logits, run(engine, {fresh: nxt}).logits)


def test_copy_prefix_errors_name_the_way_out(engine):
    a, b = engine.allocate_slot(), engine.allocate_slot()
    run(engine, {a: rand_tokens(5, 8)})
    with pytest.raises(ValueError, match=r"length=6 must be in 0..seq_len=5"):
        engine.copy_prefix(a, b, 6)
    with pytest.raises(ValueError, match="both slot"):
        engine.copy_prefix(a, a, 3)
    with pytest.raises(ValueError, match="is free"):
        engine.copy_prefix(a, 3, 3)
