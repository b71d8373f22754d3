"""specdec/heads/eagle3.py: the EAGLE-3 head read from a checkpoint in the published layout
(SafeAILab/EAGLE ``cnets.py``: fc over three fused layers, midlayer with input and hidden norms, its own
norm + lm_head over the draft vocabulary, d2t / t2d) gives the published forward and logits, and maps
draft ids to target ids.
"""

import torch

from specdec.heads import detect_format, load_head
from tests.heads.helpers import D, VD, eagle3_checkpoint, ref_layer, rms, run_cached


def test_eagle3_published_layout(tmp_path):
    d, sd = eagle3_checkpoint(tmp_path)
    assert detect_format(d) == "eagle3"
    head = load_head(d)
    assert head.cfg.method == "eagle3" and head.cfg.draft_vocab_size == VD and head.cfg.feature_size == 3 * D
    g = torch.Generator().manual_seed(3)
    emb, aux = torch.randn(6, D, generator=g), 5 * torch.randn(6, 3 * D, generator=g)
    x = aux @ sd["fc.weight"].T
    a = torch.cat([rms(emb, sd["midlayer.input_layernorm.weight"]), rms(x, sd["midlayer.hidden_norm.weight"])], -1)
    want = ref_layer(sd, "midlayer.", a, x)  # the residual stream is the fused feature, not the embedding
    got = run_cached(head, emb, aux)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    logits = rms(want, sd["norm.weight"]) @ sd["lm_head.weight"].T
    torch.testing.assert_close(head.draft_logits(got), logits, atol=1e-4, rtol=1e-4)
    d_ids = logits.argmax(-1)
    assert torch.equal(head.draft_to_target[d_ids], d_ids + sd["d2t"][d_ids])
    assert head.t2d[head.draft_to_target].all() and int(head.t2d.sum()) == VD
