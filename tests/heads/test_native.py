"""NativeHeadLayer (specdec/heads/native.py) against the torch path of ``DecoderHead.forward_cached``: the same
outputs for both head families over several slots, ragged new pairs, causal and tree masks, and rollbacks
that the blocked keys must notice."""

import copy

import pytest
import torch

from specdec.engine.cpu import build, ops
from specdec.heads import load_head
from specdec.heads.eagle import random_head

from .helpers import D, eagle1_checkpoint, eagle3_checkpoint

pytestmark = pytest.mark.skipif(ops.lib() is None, reason="CPU kernels unavailable (no compiler)")


def _pair(tmp_path, method: str, dtype=None):
    d, _ = eagle1_checkpoint(tmp_path) if method == "eagle" else eagle3_checkpoint(tmp_path)
    ref = load_head(d).float().eval()
    nat = copy.deepcopy(ref)
    for h in (ref, nat):
        h.init_cache(3, 64, torch.float32, "cpu")
    assert nat.use_native(dtype) is None
    if dtype is not None:  # the reference reads the same rounded weights
        for name, p in ref.named_parameters():
            if p.dim() == 2 and "fc" not in name and "lm_head" not in name:
                p.data = p.data.to(dtype).float()
        if dtype == torch.bfloat16 and build.choose_isa() in build.BF16_ISAS:
            # vdpbf16ps rounds a bf16 product's input to bf16 too (kernels.cpp): so does the reference
            for name, m in ref.named_modules():
                if isinstance(m, torch.nn.Linear) and "fc" not in name and "lm_head" not in name:
                    m.register_forward_pre_hook(lambda _m, a: (a[0].bfloat16().float(),))
    return ref, nat


def _feed(heads, emb, feat, pos, slots, qlens, mask=None):
    outs = [h.forward_cached(emb, feat, pos, slots, qlens, tree_mask=mask) for h in heads]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    for s in slots:
        assert heads[0].cache.seq_len(s) == heads[1].cache.seq_len(s)
    return outs[1]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_native_layer_equals_torch_path(tmp_path, method):
    ref, nat = _pair(tmp_path, method)
    F = ref.cfg.feature_size
    g = torch.Generator().manual_seed(3)
    heads = (ref, nat)
    s0, a, b = (ref.cache.allocate() for _ in range(3))
    assert [nat.cache.allocate() for _ in range(3)] == [s0, a, b]

    def r(n, w=D):
        return torch.randn(n, w, generator=g)

    # a catch-up: ragged prefills of three sequences in one forward (causal among each one's new pairs)
    _feed(heads, r(12), r(12, F), torch.cat([torch.arange(5), torch.arange(4), torch.arange(3)]), [s0, a, b], [5, 4, 3])
    # one-pair chain steps of two sequences
    _feed(heads, r(2), r(2, D), torch.tensor([5, 4]), [s0, a], [1, 1])
    # a tree expansion after a cut back (rollback): the blocked keys past the cut must be rebuilt
    for h in heads:
        h.cache.rollback(s0, 4)
        h.cache.rollback(b, 2)
    mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    _feed(heads, r(6), r(6, D), torch.tensor([4, 4, 5, 5, 2, 3]), [s0, b], [4, 2],
          mask=torch.cat([mask, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)]))
    # and again from the same cut, with other drafts (the re-feed of the next depth)
    for h in heads:
        h.cache.rollback(s0, 4)
    _feed(heads, r(3), r(3, D), torch.tensor([4, 4, 5]), [s0], [3],
          mask=torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool))
    # long enough for several key blocks of the attention's value pass (32 keys)
    _feed(heads, r(40), r(40, F), torch.arange(3, 43), [b], [40])


def test_native_layer_bf16_weights(tmp_path):
    """Packed in bf16, the layer equals the torch path over the same bf16-rounded weights."""
    ref, nat = _pair(tmp_path, "eagle", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    s = ref.cache.allocate()
    assert nat.cache.allocate() == s
    _feed((ref, nat), torch.randn(6, D, generator=g), torch.randn(6, D, generator=g), torch.arange(6), [s], [6])


def test_native_layer_refuses_a_non_fp32_cache(target):
    head = random_head(target.config, "eagle")
    head.init_cache(2, 32, torch.bfloat16, "cpu")
    assert "bfloat16" in head.use_native()
    assert head.native is None


def test_proposer_says_which_path_its_head_takes(target):
    from proposers.eagle import EagleProposer
    from specdec.spec_decode.config import SpeculativeConfig

    on = EagleProposer(target, SpeculativeConfig(method="eagle", options={"head_module": random_head(target.config, "eagle")}))
    assert on.head_kernel == "native" and on.head.native is not None
    off = EagleProposer(target, SpeculativeConfig(method="eagle", options={"head_module": random_head(target.config, "eagle"),
                                                                          "head_native": False}))
    assert off.head_kernel.startswith("torch") and off.head.native is None


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_bf16_target_keeps_the_head_and_its_tree_native(method):
    """dtype auto gives bf16 weights on AVX512-BF16 CPUs, but the kernels keep fp32 activations and caches: the head
    computes in those (the target's ``activation_dtype``), so its layer and the one-call tree stay native (a bf16 head
    cache once sent them silently to the torch path: 5.4 ms of drafting per step instead of ~1)."""
    from proposers.eagle import EagleProposer
    from proposers.eagle3 import Eagle3Proposer
    from specdec.engine.tiny import tiny_random_llama
    from specdec.spec_decode.config import SpeculativeConfig

    tgt = tiny_random_llama(0, num_slots=2, max_model_len=64, dtype=torch.bfloat16)
    assert tgt.dtype == torch.bfloat16 and tgt.activation_dtype == torch.float32
    cls = EagleProposer if method == "eagle" else Eagle3Proposer
    p = cls(tgt, SpeculativeConfig(method=method, num_speculative_tokens=3, scorer="tree", tree_depth=3, tree_topk=2,
                                   tree_budget=4, options={"head_module": random_head(tgt.config, method)}))
    assert p.head_kernel == "native" and p.tree_kernel == "native" and p.act_dtype == torch.float32


def test_native_rope_table_is_the_computed_rope(tmp_path):
    """The native path reads cos/sin from a table built over the cache's positions; it holds the values
    ``_cos_sin`` computes, and grows when a position passes the cache's length."""
    _, nat = _pair(tmp_path, "eagle3")
    for pos in (torch.tensor([0, 5, 63]), torch.tensor([70, 2])):  # the cache holds 64 positions
        cos, sin = nat._rope_rows(pos)
        want = nat._cos_sin(pos, torch.float32)
        torch.testing.assert_close(cos, want[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, want[1], atol=1e-6, rtol=0)
    assert nat._rope_table[0].shape[0] == 71


def _fused_step_matches(ref, nat, ref_fn, nat_fn, vocab: int, seed: int, logits_tol: dict) -> tuple[int, int]:
    """``nat.forward_logits`` (a fused draft step) against the torch path ``DecoderHead.forward_logits`` of ``ref``: a
    catch-up from the target's features over two ragged sequences, then a tree re-feed of the head's own outputs
    after a rollback; outputs within 2e-5, logits [rows, vocab] within ``logits_tol``, the caches in step.
    -> the two slots."""
    from specdec.heads.layers import DecoderHead

    F = ref.cfg.feature_size
    g = torch.Generator().manual_seed(seed)
    s0, a = (ref.cache.allocate() for _ in range(2))
    assert [nat.cache.allocate() for _ in range(2)] == [s0, a]

    def both(emb, feat, pos, slots, qlens, rows, mask=None):
        want = DecoderHead.forward_logits(ref, emb, feat, pos, slots, qlens, rows, ref_fn, mask)
        got = nat.forward_logits(emb, feat, pos, slots, qlens, rows, nat_fn, mask)
        torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got[1], want[1], **logits_tol)
        assert got[1].shape == (len(rows), vocab)
        for s in slots:
            assert ref.cache.seq_len(s) == nat.cache.seq_len(s)

    both(torch.randn(9, D, generator=g), torch.randn(9, F, generator=g),
         torch.cat([torch.arange(5), torch.arange(4)]), [s0, a], [5, 4], [4, 8])
    for h in (ref, nat):
        h.cache.rollback(s0, 4)
    mask = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    both(torch.randn(3, D, generator=g), torch.randn(3, D, generator=g), torch.tensor([4, 4, 5]), [s0], [3], [1, 2],
         mask)
    return s0, a


def test_eagle3_step_equals_forward_cached_and_draft_logits(tmp_path):
    """``NativeHeadLayer.step`` (fuse, layer and draft LM head in one call of the kernels) gives the outputs and the
    draft logits of the torch path (``_fused_step_matches``)."""
    ref, nat = _pair(tmp_path, "eagle3")
    assert nat.native.fused is not None
    _, a = _fused_step_matches(ref, nat, ref.draft_logits, nat.draft_logits, ref.cfg.draft_vocab_size, 11,
                               dict(atol=2e-5, rtol=2e-5))
    with pytest.raises(ValueError, match="out_rows"):
        nat.native.step(torch.randn(1, D), torch.randn(1, D), *nat._rope_rows(torch.tensor([9])), [a], [1], None, [1])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_eagle1_step_equals_forward_cached_and_lm_rows(tmp_path, target, dtype):
    """``NativeHeadLayer.step_eagle1`` (fc over cat(emb, feat), the layer and the target's LM head rows in one call)
    gives the outputs and logits of the torch path with the same ``LMHeadRows`` (``_fused_step_matches``). Any
    other ``logits_fn`` takes the two-call path."""
    from specdec.heads.common import LMHeadRows

    ref, nat = _pair(tmp_path, "eagle")
    assert nat.native.fused is None and nat.native.fc1 is not None
    rows_ids = torch.arange(0, 512, 3)  # a draft vocabulary of 171 target ids
    lm = LMHeadRows(target, rows_ids, dtype)
    assert lm._native is not None
    ref_fn = (lambda h: (h.float() @ lm._native.w.float().T)) if dtype is not None else lm.logits
    tol = dict(atol=2e-5, rtol=2e-5) if dtype is None else dict(atol=3e-2, rtol=3e-2)
    _, a = _fused_step_matches(ref, nat, ref_fn, lm.logits, len(rows_ids), 12, tol)
    with pytest.raises(ValueError, match="out_rows"):
        nat.native.step_eagle1(torch.randn(1, D), torch.randn(1, D), *nat._rope_rows(torch.tensor([9])), [a], [1],
                               None, [1], lm._native)
    g = torch.Generator().manual_seed(13)
    # a logits_fn that is not LMHeadRows.logits: the layer, then the function (same outputs)
    emb, feat = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)
    for h in (ref, nat):
        h.cache.rollback(a, 4)
    out, lg = nat.forward_logits(emb, feat, torch.tensor([4, 5]), [a], [2], [1], lambda h: h[:, :7].float())
    assert lg.shape == (1, 7) and torch.equal(lg, out[1:, :7].float())
