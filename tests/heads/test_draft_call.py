"""The EAGLE draft of a step in one native call (specdec/heads/draft_call.py: the catch-up, then every depth of the tree)
against its torch reference: the same tokens, parents and ranks, the draft log-probs within tolerance, on tiny seeded
heads and the shipped heads, weights packed in fp32 and bf16, batch 1 and 3 with ragged catch-ups of 1, 2 and 4 rows;
the head's KV cache and the catch-up's outputs exactly those of the two-call path it replaces (the head's native step,
then the tree); and the contract against the re-feeding tree (build_ranked_tree + head_expand)."""

import itertools

import pytest
import torch

from specdec.engine.cpu import build, ops
from specdec.heads import load_head
from specdec.heads.common import CHECKPOINTS, LMHeadRows
from specdec.heads.draft_call import NativeDraftTree, draft_tree_ref
from specdec.heads.eagle import random_head
from specdec.spec_decode.proposer import TreeShape

pytestmark = pytest.mark.skipif(ops.lib() is None, reason="CPU kernels unavailable (no compiler)")

# vdpbf16ps (the AVX512_BF16 build) rounds a bf16 product's input to bf16 (the reference does too: DraftWeights.round_x)
# and adds each pair of products before the accumulator, an order torch's fp32 sum does not keep: log-probs agree to
# ~1e-3 there, to ~1e-5 where bf16 is widened to fp32 (AVX2, generic)
EXACT_BF16 = build.choose_isa() not in build.BF16_ISAS


def _tol(dtype) -> float:
    return 1e-4 if dtype is None or EXACT_BF16 else 2e-3


def _native(head, emb_rows: torch.Tensor, lm_rows: torch.Tensor | None, dtype, slots: int = 4, max_len: int = 96):
    """head packed in ``dtype`` with a fresh cache; emb [Vd, D] and (EAGLE-1) lm rows [Vd, D] packed alike."""
    head = head.float().eval()
    head.init_cache(slots, max_len, torch.float32, "cpu")
    assert head.use_native(dtype) is None
    emb = emb_rows.float().contiguous()
    lm = None if lm_rows is None else ops.NativeWeight(lm_rows.to(dtype or torch.float32).contiguous())
    return NativeDraftTree(head, emb, lm)


def _prefix(head, B: int, lens: list[int], seed: int) -> tuple[list[int], torch.Generator]:
    """Fill B slots with ``lens`` random pairs (those kept from earlier steps) -> (slots, the generator)."""
    g = torch.Generator().manual_seed(seed)
    D, Fw = head.cfg.hidden_size, head.cfg.feature_size
    slots = [head.cache.allocate() for _ in range(B)]
    n = sum(lens)
    head.forward_cached(torch.randn(n, D, generator=g), torch.randn(n, Fw, generator=g),
                        torch.cat([torch.arange(m) for m in lens]), slots, lens)
    return slots, g


def _rows(head, lens: list[int], qlens: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Catch-up rows after ``lens`` kept pairs: (embeddings [R, D], target features [R, F], positions [R])."""
    R, D, Fw = sum(qlens), head.cfg.hidden_size, head.cfg.feature_size
    pos = [m + i for m, q in zip(lens, qlens) for i in range(q)]
    return torch.randn(R, D, generator=g), torch.randn(R, Fw, generator=g), pos


def _two_calls(nat: NativeDraftTree, emb, feat, pos, qlens, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The catch-up as EagleProposer ran it before the one call (the head's native step, logits at each sequence's
    last row) -> (last [B, D], root logits [B, Vd]); the slots advance by qlens."""
    cos, sin = nat.head._rope_rows(torch.tensor(pos))
    ends = [e - 1 for e in itertools.accumulate(qlens)]
    if nat.kind == 3:
        out, logits = nat.layer.step(emb, feat, cos, sin, slots, qlens, None, ends)
    else:
        out, logits = nat.layer.step_eagle1(emb, feat, cos, sin, slots, qlens, None, ends, nat.lm)
    return out[ends], logits


def _check(nat: NativeDraftTree, B: int, shape: TreeShape, seed: int, d2t=None, lp_tol: float = 1e-4,
           qlens: list[int] | None = None, exact: bool = True):
    head, cache = nat.head, nat.head.cache
    qlens = qlens or [1, 2, 4][:B]
    slots, g = _prefix(head, B, [7, 12, 5][:B], seed)
    lens = [cache.seq_len(s) for s in slots]
    emb, feat, pos = _rows(head, lens, qlens, g)
    k0, v0 = cache.k_layers[0].clone(), cache.v_layers[0].clone()
    got = nat(emb, feat, pos, qlens, slots, shape, d2t)
    # the catch-up's pairs are the slots' now; the drafted keys past them are scratch
    assert [cache.seq_len(s) for s in slots] == [m + q for m, q in zip(lens, qlens)]
    k1, v1 = cache.k_layers[0].clone(), cache.v_layers[0].clone()
    want = draft_tree_ref(nat.weights(), k0.clone(), v0.clone(), emb, feat, pos, qlens, slots, lens, shape, d2t)
    k = min(shape.topk, nat.lm.shape[0])
    N = min(shape.budget, k + (shape.depth - 1) * k * k)
    assert got.tokens.shape == (B, N) and got.num_nodes.tolist() == [N] * B
    if exact:
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.parents, want.parents)
        assert torch.equal(got.rank, want.rank)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=lp_tol, rtol=lp_tol)
    else:  # a near-tie may flip a node (and so what hangs below it and the nodes' order): most of the tree's paths agree,
        # and where they do, their scores, within a bound per depth (each depth runs the layer again on the last one's
        # hidden state through products that round their input to bf16; Intel's vdpbf16ps and AMX drift further than
        # Zen 4's: a 6-token path of the EAGLE-1 head 0.21 on a score of 3.2)
        for b in range(B):
            paths = [_paths(t.tokens[b], t.parents[b], t.logprobs[b]) for t in (got, want)]
            common = paths[0].keys() & paths[1].keys()
            assert len(common) >= 0.75 * len(paths[0]), (len(common), len(paths[0]))
            for path in common:
                assert abs(paths[0][path] - paths[1][path]) <= lp_tol * len(path) * (1 + abs(paths[1][path])), path
    torch.testing.assert_close(got.last, want.last, atol=lp_tol, rtol=lp_tol)
    if exact:
        torch.testing.assert_close(got.root_logits, want.root_logits, atol=lp_tol, rtol=lp_tol)
    else:  # a bf16 product rounds its input, so an input's last-bit difference can move one term by 2^-8 of it:
        # the root logits (an LM head over `last`) then differ in proportion to the row's scale (seen on Intel's
        # vdpbf16ps and AMX: 0.07-0.095 where logits reach ~10), not per element
        scale = want.root_logits.abs().amax(-1, keepdim=True).clamp_min(1.0)
        torch.testing.assert_close(got.root_logits / scale, want.root_logits / scale, atol=lp_tol, rtol=0)
    # a tree: parents before children, and ranks prefix-closed (a parent ranks before its child)
    for b in range(B):
        for i, p in enumerate(got.parents[b].tolist()):
            assert -1 <= p < i and (p < 0 or got.rank[b, p] < got.rank[b, i])
    # the two-call path from the same cache: the same keys and values of the committed pairs, bit for bit, and the
    # same catch-up outputs (the tree of the old path drafted from exactly these)
    cache.k_layers[0].copy_(k0), cache.v_layers[0].copy_(v0)
    for s, m in zip(slots, lens):
        cache.rollback(s, m)
    last, root = _two_calls(nat, emb, feat, pos, qlens, slots)
    assert torch.equal(got.last, last) and torch.equal(got.root_logits, root)
    for s, m, q in zip(slots, lens, qlens):
        assert cache.seq_len(s) == m + q
        assert torch.equal(k1[s, :, :m + q], cache.k_layers[0][s, :, :m + q])
        assert torch.equal(v1[s, :, :m + q], cache.v_layers[0][s, :, :m + q])
    for s in slots:
        cache.free(s)
    return got


def _paths(tokens: torch.Tensor, parents: torch.Tensor, logprobs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """A tree's nodes as {their path of tokens from the root: their log-prob}."""
    out, by_node = {}, {}
    for i, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist())):
        by_node[i] = (by_node[p] if p >= 0 else ()) + (t,)
        out[by_node[i]] = float(logprobs[i])
    return out


SHAPES = [TreeShape(3, 3, 6), TreeShape(6, 4, 20), TreeShape(1, 4, 3), TreeShape(4, 2, 100)]
ONE_ROWS = [[1], [2], [4], [2]]  # batch 1: the catch-up's rows per shape (batch 3: 1, 2 and 4)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
def test_tiny_eagle3_native_equals_reference(target, dtype, B):
    head = random_head(target.config, "eagle3", seed=4)
    d2t = head.draft_to_target
    nat = _native(head, target.embed(d2t), None, dtype)
    for i, shape in enumerate(SHAPES):
        tree = _check(nat, B, shape, 10 + i, d2t, qlens=ONE_ROWS[i] if B == 1 else None, lp_tol=_tol(dtype))
        assert bool((tree.tokens.unsqueeze(-1) == d2t).any(-1).all())  # target ids of the draft vocabulary


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
def test_tiny_eagle1_native_equals_reference(target, dtype, B):
    head = random_head(target.config, "eagle", seed=5)
    ids = torch.arange(0, target.vocab_size, 2)  # a draft vocabulary of 256 target ids
    lm = LMHeadRows(target, ids)
    nat = _native(head, target.embed(ids), lm.weight, dtype)
    for i, shape in enumerate(SHAPES):
        _check(nat, B, shape, 20 + i, ids, qlens=ONE_ROWS[i] if B == 1 else None, lp_tol=_tol(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_shipped_heads_native_equals_reference(method, dtype):
    """The trained heads' weights and shapes (SmolLM2-135M's: D 576, 9 heads, 3 KV heads); the embedding and the
    EAGLE-1 LM head rows are seeded random [4096, D] (the contract takes them as inputs; no target loads)."""
    head = load_head(CHECKPOINTS / f"smollm2-135m-instruct-{method}")
    D = head.cfg.hidden_size
    g = torch.Generator().manual_seed(7)
    Vd = head.cfg.draft_vocab_size if method == "eagle3" else 4096
    emb = torch.randn(Vd, D, generator=g) * 0.05
    lm = None if method == "eagle3" else torch.randn(Vd, D, generator=g) * 0.5
    nat = _native(head, emb, lm, dtype, slots=3)
    tol = 1e-4 if dtype is None else 2e-3 if EXACT_BF16 else 3e-2
    exact = dtype is None or EXACT_BF16  # the trained heads' deeper trees hold near-ties that vdpbf16ps's order flips
    for i, shape in enumerate([TreeShape(3, 3, 6), TreeShape(6, 4, 20)]):
        _check(nat, 3, shape, 30 + i, lp_tol=tol, exact=exact)
        _check(nat, 1, shape, 40 + i, lp_tol=tol, qlens=[[4], [2]][i], exact=exact)


def test_contract_equals_the_refeeding_tree(target):
    """The appended-once tree is the tree EAGLE-2's re-feeding expansion builds (build_ranked_tree + head_expand, the
    path it replaces): same tokens, parents and ranks, one sequence and two."""
    from proposers.dynamic_tree import build_ranked_tree, head_expand

    head = random_head(target.config, "eagle3", seed=6)
    d2t = head.draft_to_target
    nat = _native(head, target.embed(d2t), None, None)
    for B, shape in ((1, TreeShape(3, 3, 6)), (2, TreeShape(5, 3, 12)), (1, TreeShape(6, 4, 20))):
        slots, g = _prefix(head, B, [9, 6][:B], 40 + B)
        qlens = [2, 3][:B]
        got = nat(*_rows(head, [9, 6][:B], qlens, g), qlens, slots, shape, d2t)
        committed = [head.cache.seq_len(s) for s in slots]
        pos0 = [m + q - 1 for m, q in zip([9, 6], qlens)]
        expand = head_expand(head, target.embed, head.draft_logits, lambda p: _tree_mask(p), got.last, slots,
                             committed, torch.tensor(pos0), d2t, d2t.numel(), shape)
        tree, _, rank = build_ranked_tree(torch.log_softmax(got.root_logits, -1), expand, shape)
        for s, n in zip(slots, committed):
            head.cache.rollback(s, n)
        assert torch.equal(got.tokens, d2t[tree.token_ids])
        assert torch.equal(got.parents, tree.parents)
        assert torch.equal(got.rank, rank)
        for s in slots:
            head.cache.free(s)


def _tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, n] root-inclusive parents (-1 at the root) -> [B, n, n] ancestor-or-self mask."""
    B, n = parents.shape
    m = torch.zeros(B, n, n, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            p = int(parents[b, i])
            if p >= 0:
                m[b, i] = m[b, p]
            m[b, i, i] = True
    return m


def test_native_call_refuses_a_tree_past_the_cache(target):
    head = random_head(target.config, "eagle3", seed=4)
    nat = _native(head, target.embed(head.draft_to_target), None, None, max_len=16)
    slots, g = _prefix(head, 1, [12], 1)
    with pytest.raises(ValueError, match="max_model_len"):  # 12 kept + 1 catch-up row + 3 x 3 nodes > 16
        nat(*_rows(head, [12], [1], g), [1], slots, TreeShape(4, 3, 6))
    assert head.cache.seq_len(slots[0]) == 12  # refused before anything was fed


def test_native_call_refuses_a_repacked_head(target):
    """The call's descriptors point into the packed layer it was built on: after ``use_native()`` packs the head again
    it refuses, naming the way out, instead of reading freed weights."""
    head = random_head(target.config, "eagle3", seed=4)
    nat = _native(head, target.embed(head.draft_to_target), None, None)
    slots, g = _prefix(head, 1, [5], 2)
    assert head.use_native(None) is None
    with pytest.raises(RuntimeError, match="build a new NativeDraftTree"):
        nat(*_rows(head, [5], [1], g), [1], slots, TreeShape(3, 3, 6))
