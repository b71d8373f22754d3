"""NativeEngine behaviour beyond plain logits: rollback, tree attention, positions, compact, errors."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.interface import ForwardBatch
from specdec.engine.testing import hf_logits, rand_tokens, run
from specdec.engine.tiny import tiny_random_llama, to_hf_model

# A token tree over 6 new tokens:      0
#                                     / \
#                                    1   2
#                                   / \   \
#                                  3   4   5
PARENTS = [-1, 0, 0, 1, 1, 2]
PATHS = [[0, 1, 3], [0, 1, 4], [0, 2, 5]]  # root-to-leaf node indices


def _ancestors(i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = PARENTS[i]
    return out[::-1]


def tree_mask() -> torch.Tensor:
    m = torch.zeros(len(PARENTS), len(PARENTS), dtype=torch.bool)
    for i in range(len(PARENTS)):
        m[i, _ancestors(i)] = True
    return m


DEPTHS = [len(_ancestors(i)) - 1 for i in range(len(PARENTS))]


@pytest.fixture
def engine():
    return tiny_random_llama(0, num_slots=6, max_model_len=64)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def any_engine(request):
    """fp32 and bf16 weights: a bf16 model's kernels keep their own bf16 copies of K and V (ops.attention_copies),
    which rollback, compaction and slot reuse must keep in step with the cache."""
    return tiny_random_llama(0, num_slots=6, max_model_len=64, dtype=request.param)


def test_rollback_then_redecode_is_exact(any_engine):
    engine = any_engine
    s = engine.allocate_slot()
    prompt, cont = rand_tokens(10, 1), rand_tokens(4, 2)
    run(engine, {s: prompt})
    first = [run(engine, {s: [t]}).logits for t in cont]
    engine.rollback(s, 10)
    assert engine.seq_len(s) == 10
    again = [run(engine, {s: [t]}).logits for t in cont]
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    # rolling back and appending different tokens overwrites the stale entries
    engine.rollback(s, 10)
    run(engine, {s: rand_tokens(3, 9)})
    engine.rollback(s, 10)
    assert torch.equal(run(engine, {s: [cont[0]]}).logits, first[0])


def test_free_makes_slot_reusable_and_fresh(any_engine):
    engine = any_engine
    slots = [engine.allocate_slot() for _ in range(engine.num_slots)]
    assert slots == list(range(6)) and engine.num_free_slots() == 0
    toks = rand_tokens(5, 3)
    ref = run(engine, {slots[2]: toks}).logits
    engine.free_slot(slots[2])
    assert engine.num_free_slots() == 1
    s = engine.allocate_slot()
    assert s == slots[2] and engine.seq_len(s) == 0
    assert torch.equal(run(engine, {s: toks}).logits, ref)


def test_errors_name_value_and_way_out(engine):
    s = engine.allocate_slot()
    with pytest.raises(ValueError, match=r"slot 0: 65 tokens exceed max_model_len=64; raise max_model_len"):
        run(engine, {s: rand_tokens(65, 1)})
    run(engine, {s: rand_tokens(60, 1)})
    with pytest.raises(ValueError, match=r"slot 0: 65 tokens exceed max_model_len=64"):
        run(engine, {s: rand_tokens(5, 2)})
    assert engine.seq_len(s) == 60  # a refused forward changes nothing
    engine.free_slot(s)
    with pytest.raises(ValueError, match="slot 0 is free"):
        engine.free_slot(s)
    with pytest.raises(ValueError, match="slot 0 is free"):
        run(engine, {s: [5]})
    for _ in range(engine.num_slots):
        engine.allocate_slot()
    with pytest.raises(RuntimeError, match="num_slots=6"):
        engine.allocate_slot()
    with pytest.raises(ValueError, match=r"must be in 0\.\.0"):
        engine.rollback(1, 3)
    with pytest.raises(ValueError, match="repeat a slot"):
        engine.forward(ForwardBatch(torch.tensor([5, 6]), [1, 1], [1, 1]))
    with pytest.raises(ValueError, match="sum\\(query_lens\\)=3 != 2"):
        engine.forward(ForwardBatch(torch.tensor([5, 6]), [1, 2], [1, 2]))


def test_max_model_len_checked_against_model_and_window():
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        tiny_random_llama(0, max_model_len=9000)
    with pytest.raises(ValueError, match="sliding_window=32 < max_model_len=64"):
        tiny_random_llama(0, max_model_len=64, model_type="mistral", sliding_window=32)


def test_positions_are_honoured(engine):
    hf = to_hf_model(engine)
    toks = rand_tokens(6, 4)
    pos = [0, 2, 3, 7, 8, 8]  # not a uniform shift: RoPE is relative, so that would change nothing
    s = engine.allocate_slot()
    got = run(engine, {s: toks}, positions=torch.tensor(pos)).logits
    assert (got - hf_logits(hf, toks, positions=pos)).abs().max() <= 1e-3
    assert (got - hf_logits(hf, toks)).abs().max() > 1e-2  # the positions did change the result


def test_tree_mask_equals_causal_forward_of_each_path(engine):
    prefix, nodes = rand_tokens(7, 5), rand_tokens(len(PARENTS), 6)
    other = rand_tokens(4, 7)
    t, o = engine.allocate_slot(), engine.allocate_slot()
    run(engine, {t: prefix, o: other[:2]})
    # one batch: the tree for slot t, and a plain 2-token chain for slot o expressed as a causal mask
    mask = torch.zeros(len(PARENTS) + 2, len(PARENTS), dtype=torch.bool)
    mask[: len(PARENTS)] = tree_mask()
    mask[len(PARENTS) :, :2] = torch.tensor([[True, False], [True, True]])
    positions = torch.tensor([7 + d for d in DEPTHS] + [2, 3])
    out = run(engine, {t: nodes, o: other[2:]}, tree_mask=mask, positions=positions)
    assert engine.seq_len(t) == 7 + len(PARENTS)  # tree tokens take consecutive cache entries
    for path in PATHS:
        p = engine.allocate_slot()
        ref = run(engine, {p: prefix + [nodes[i] for i in path]}).logits[7:]
        assert (out.logits[path] - ref).abs().max() <= 1e-4, f"path {path}"
        engine.free_slot(p)
    q = engine.allocate_slot()
    ref_o = run(engine, {q: other}).logits[2:]
    assert (out.logits[len(PARENTS) :] - ref_o).abs().max() <= 1e-4


def test_batched_trees_equal_single_tree_forwards(engine):
    # two sequences with the same-shaped tree (uniform query lengths: the batched attention path)
    prefixes, nodes = [rand_tokens(7, 5), rand_tokens(4, 9)], [rand_tokens(6, 6), rand_tokens(6, 10)]
    a, b = engine.allocate_slot(), engine.allocate_slot()
    run(engine, {a: prefixes[0], b: prefixes[1]})
    pos = [7 + d for d in DEPTHS] + [4 + d for d in DEPTHS]
    out = run(engine, {a: nodes[0], b: nodes[1]}, tree_mask=tree_mask().repeat(2, 1), positions=torch.tensor(pos))
    for i in range(2):
        s = engine.allocate_slot()
        run(engine, {s: prefixes[i]})
        ref = run(engine, {s: nodes[i]}, tree_mask=tree_mask(), positions=torch.tensor(pos[6 * i : 6 * i + 6])).logits
        assert (out.logits[6 * i : 6 * i + 6] - ref).abs().max() <= 1e-4
        engine.free_slot(s)


@pytest.mark.parametrize("path", PATHS)
def test_compact_accepted_path_then_continue_equals_direct_decode(any_engine, path):
    engine = any_engine
    prefix, nodes, nxt = rand_tokens(7, 5), rand_tokens(len(PARENTS), 6), rand_tokens(3, 8)
    t = engine.allocate_slot()
    run(engine, {t: prefix})
    run(engine, {t: nodes}, tree_mask=tree_mask(), positions=torch.tensor([7 + d for d in DEPTHS]))
    engine.compact(t, torch.tensor([7 + i for i in path]), 7)
    assert engine.seq_len(t) == 7 + len(path)
    got = run(engine, {t: nxt}).logits
    d = engine.allocate_slot()
    ref = run(engine, {d: prefix + [nodes[i] for i in path] + nxt}).logits[-3:]
    assert (got - ref).abs().max() <= 1e-4


def test_a_bf16_model_scores_and_weighs_its_own_bf16_copies_of_k_and_v():
    """A bf16 model on an AVX512_BF16 build attends over bf16 copies of K (blocked, dotted with vdpbf16ps) and V
    (ops.attention_copies), filled from the fp32 cache once per key: after a rollback the keys below the cut are read
    from the copies, not the cache (so a changed cache changes nothing and a changed copy does). An fp32 model keeps
    fp32 keys and reads V from the cache."""
    from specdec.engine.cpu import ops

    e32 = tiny_random_llama(0, num_slots=2, max_model_len=64)
    e16 = tiny_random_llama(0, num_slots=2, max_model_len=64, dtype=torch.bfloat16)
    if e16._stack is None or ops.lib().sd_isa() < 2:
        pytest.skip("bf16 copies need the native kernels' AVX512_BF16 build")
    assert e32._stack.kt.dtype == torch.float32 and e32._stack.vh is None
    st = e16._stack
    assert st.kt.dtype == torch.int16 and st.vh is not None and st.vh.dtype == torch.int16
    assert e16.describe()["attention"] == "bf16 copies of K and V" and e32.describe()["attention"] == "float32"
    # attention_dtype reaches the copies: a bf16 model's stack built with float32 attention keeps fp32 ones
    from specdec.engine.cpu.stack import NativeStack

    alt = NativeStack(e16.model, e16.cache, share=st, attention_dtype=torch.float32)
    assert alt.kt.dtype == torch.float32 and alt.vh is None
    s = e16.allocate_slot()
    prompt, nxt = rand_tokens(10, 1), rand_tokens(1, 2)
    run(e16, {s: prompt})
    ref = run(e16, {s: nxt}).logits
    e16.rollback(s, 10)
    e16.cache.v[:, s, :, :10] = 0  # the fp32 values the copies were made from
    assert torch.equal(run(e16, {s: nxt}).logits, ref)
    e16.rollback(s, 10)
    st.vh[:, s, :, :10] = 0
    assert not torch.equal(run(e16, {s: nxt}).logits, ref)
