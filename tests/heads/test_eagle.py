"""specdec/heads/eagle.py: the EAGLE-1 head read from a checkpoint in the published layout
(SafeAILab/EAGLE ``cnets1.py``, .bin and safetensors) gives the published forward (helpers.ref_layer, an
independent transcription: a wrong key mapping, a missing norm or a swapped concat order fails here); the
fit check refuses an EAGLE-1 or EAGLE-3 head that does not fit the target, naming both sizes; a tree mask
with depth positions equals separate causal branches.
"""

import pytest
import torch

from proposers.eagle import EagleProposer
from proposers.eagle3 import Eagle3Proposer
from specdec.engine.tiny import tiny_random_llama
from specdec.heads import detect_format, load_head
from specdec.spec_decode.config import SpeculativeConfig
from tests.heads import helpers
from tests.heads.helpers import D, eagle1_checkpoint, eagle3_checkpoint, ref_layer, run_cached


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle1_published_layout(tmp_path, fmt):
    d, sd = eagle1_checkpoint(tmp_path, fmt)
    assert detect_format(d) == "eagle"
    head = load_head(d)
    assert head.cfg.method == "eagle" and head.cfg.hidden_size == D and head.cfg.fc_bias
    g = torch.Generator().manual_seed(2)
    emb, feat = torch.randn(7, D, generator=g), torch.randn(7, D, generator=g)
    x = torch.cat([emb, feat], -1) @ sd["fc.weight"].T + sd["fc.bias"]  # cat order: (embedding, feature)
    want = ref_layer(sd, "layers.0.", x, x)  # no input_layernorm on the EAGLE-1 layer
    torch.testing.assert_close(run_cached(head, emb, feat), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head.forward_train(emb[None], feat[None])[0][0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method, field, value", [("eagle", "hidden_size", 48), ("eagle", "vocab_size", 640),
                                                  ("eagle3", "hidden_size", 48), ("eagle3", "vocab_size", 640)])
def test_a_checkpoint_that_does_not_fit_the_target_is_refused_naming_both(tmp_path, method, field, value,
                                                                           monkeypatch):
    with monkeypatch.context() as m:  # the checkpoint builders read helpers.D / helpers.V when called
        m.setattr(helpers, "D" if field == "hidden_size" else "V", value)
        d, _ = eagle1_checkpoint(tmp_path) if method == "eagle" else eagle3_checkpoint(tmp_path)
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)  # hidden_size 64, vocab 512
    cls = EagleProposer if method == "eagle" else Eagle3Proposer
    with pytest.raises(ValueError, match=rf"{field}={value} but the target has {field}={getattr(target, field)}"):
        cls(target, SpeculativeConfig(method=method, options={"head": str(d)}))


def test_tree_mask_equals_separate_causal_branches(tmp_path):
    """Two branches after a shared prefix, fed at once with a tree mask and depth positions, give the
    outputs of each branch fed causally on its own (what an EAGLE-2 tree expansion needs)."""
    d, _ = eagle1_checkpoint(tmp_path)
    head = load_head(d)
    g = torch.Generator().manual_seed(4)
    emb, feat = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)
    head.init_cache(3, 64, torch.float32, "cpu")
    a, b, t = head.cache.allocate(), head.cache.allocate(), head.cache.allocate()
    for s in (a, b, t):  # the shared prefix: pairs 0, 1
        head.forward_cached(emb[:2], feat[:2], torch.arange(2), [s], [2])
    want_a = head.forward_cached(emb[2:4], feat[2:4], torch.tensor([2, 3]), [a], [2])  # branch A: pairs 2, 3
    want_b = head.forward_cached(emb[4:5], feat[4:5], torch.tensor([2]), [b], [1])  # branch B: pair 4 at depth 2
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)  # rows: A1, A2, B1
    got = head.forward_cached(emb[2:5], feat[2:5], torch.tensor([2, 3, 2]), [t], [3], tree_mask=mask)
    torch.testing.assert_close(got[:2], want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2:], want_b, atol=1e-5, rtol=1e-5)
