"""Batch invariance, the property greedy speculation rests on: a row's logits and hidden state are
bit-identical (``torch.equal``) whatever M is, whatever sequences share the forward and whichever slot it
sits in, for chain (causal) and tree masks, in fp32 and bf16. Each case draws a random batch (1-8 ragged
sequences, M <= 33 new tokens, scattered slots), runs it as one forward, then recomputes every row alone:
its prefix, then its own path decoded one token at a time in another slot.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.interface import ForwardBatch
from specdec.engine.loader import load_engine

pytestmark = pytest.mark.skipif(
    not load_engine("tiny-random-llama", num_slots=1, max_model_len=8).batch_invariant,
    reason="native kernels unavailable: the torch reference path is not batch-invariant",
)


def _random_tree(rng: random.Random, n: int) -> list[int]:
    """parents[i] < i, or -1 for a child of the prefix (a chain is parents[i] = i - 1)."""
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def _paths(parents: list[int]) -> list[list[int]]:
    out = []
    for i in range(len(parents)):
        p, j = [], i
        while j >= 0:
            p.append(j)
            j = parents[j]
        out.append(p[::-1])
    return out


def _check(engine, seed: int, tree: bool, max_prefix: int = 40, qlens: list[int] | None = None) -> None:
    """``qlens``: the new tokens per sequence (default: 1-8 random sequences of 1-8 tokens, 33 in all at most)."""
    rng = random.Random(seed)
    V = engine.vocab_size
    if qlens is None:
        B = rng.randint(1, 8)
        qlens = [rng.randint(1, 8) for _ in range(B)]
        while sum(qlens) > 33:
            qlens[qlens.index(max(qlens))] -= 1
    B = len(qlens)
    free = list(range(engine.num_slots))
    rng.shuffle(free)
    slots, spare = free[:B], free[B]  # scattered slots; one more to recompute rows alone in
    for s in sorted(free):
        engine.allocate_slot()
    prefixes = [[rng.randrange(V) for _ in range(rng.randint(1, max_prefix))] for _ in range(B)]
    news = [[rng.randrange(V) for _ in range(n)] for n in qlens]
    trees = [_random_tree(rng, n) if tree else list(range(-1, n - 1)) for n in qlens]
    for s, p in zip(slots, prefixes):
        engine.forward(ForwardBatch(torch.tensor(p), [s], [len(p)]))
    ids = torch.tensor([t for n in news for t in n])
    mask = pos = None
    if tree:
        W = max(qlens)
        mask = torch.zeros(sum(qlens), W, dtype=torch.bool)
        pos_l, r = [], 0
        for p, par in zip(prefixes, trees):
            for path in _paths(par):
                mask[r, path] = True
                pos_l.append(len(p) + len(path) - 1)
                r += 1
        pos = torch.tensor(pos_l)
    out = engine.forward(ForwardBatch(ids, slots, qlens, positions=pos, tree_mask=mask))
    r = 0
    for p, new, par in zip(prefixes, news, trees):
        for path in _paths(par):
            engine.rollback(spare, 0)
            engine.forward(ForwardBatch(torch.tensor(p), [spare], [len(p)]))
            for j in path:  # the row's own tokens, one forward each: plain decoding
                alone = engine.forward(ForwardBatch(torch.tensor([new[j]]), [spare], [1]))
            assert torch.equal(out.logits[r], alone.logits[0]), f"seed {seed}: row {r} differs from its plain decode"
            assert torch.equal(out.hidden_states[r], alone.hidden_states[0]), f"seed {seed}: row {r} hidden state"
            r += 1
    for s in range(engine.num_slots):
        engine.free_slot(s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_rows_are_batch_invariant_tiny(dtype, tree):
    engine = load_engine("tiny-random-llama", num_slots=12, max_model_len=128, dtype=dtype)
    for seed in range(25):
        _check(engine, seed, tree)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("rows", [11, 17, 33])
def test_one_sequence_of_many_rows_is_invariant(dtype, tree, rows):
    """One sequence of many new tokens: the attention splits its queries into several blocks per KV head (of
    balanced size, as many as the threads divide), and groups within a block by the register tiles."""
    engine = load_engine("tiny-random-llama", num_slots=4, max_model_len=128, dtype=dtype)
    for seed in range(2):
        _check(engine, seed, tree, qlens=[rows])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_batch_invariant_smollm2(dtype):
    engine = load_engine("smollm2-135m-instruct", num_slots=10, max_model_len=128, dtype=dtype)
    _check(engine, seed=3, tree=False, max_prefix=24)
    _check(engine, seed=4, tree=True, max_prefix=24)
    _check(engine, seed=5, tree=True, max_prefix=24, qlens=[17])  # 51 queries per KV head: 6 blocks of 8-9
