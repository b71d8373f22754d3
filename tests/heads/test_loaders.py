"""Loaders of the published draft-head layouts, on synthetic checkpoints written key for key as the EAGLE
repositories publish them (SafeAILab/EAGLE: ``cnets1.py`` for EAGLE-1, ``cnets.py`` for EAGLE-3).

Each loaded head is checked against an independent plain-torch transcription of the published forward
(explicit repeat_kv, rotate_half, additive causal mask), so a wrong key mapping, a missing norm or a
swapped concat order fails here. A head that does not fit the target is refused naming both sizes.
"""

import json
import math

import pytest
import torch

from proposers.eagle import EagleProposer
from proposers.eagle3 import Eagle3Proposer
from specdec.engine.tiny import tiny_random_llama
from specdec.heads import detect_format, load_head, read_head, write_eagle1, write_eagle3
from specdec.spec_decode.config import SpeculativeConfig

D, NH, NKV, HD, I, V, VD = 64, 4, 2, 16, 128, 512, 96
THETA, EPS = 10000.0, 1e-5


def llama_config(**extra) -> dict:
    """config.json as the EAGLE repositories publish it: a LlamaConfig with one layer."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": D, "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
            "head_dim": HD,
            "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": THETA, "vocab_size": V,
            "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "float16", "tie_word_embeddings": False, **extra}


def rnd(*shape, g):
    return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])


def layer_tensors(prefix: str, attn_in: int, g, norms=("post_attention_layernorm",)) -> dict:
    t = {f"{prefix}self_attn.q_proj.weight": rnd(NH * HD, attn_in, g=g),
         f"{prefix}self_attn.k_proj.weight": rnd(NKV * HD, attn_in, g=g),
         f"{prefix}self_attn.v_proj.weight": rnd(NKV * HD, attn_in, g=g),
         f"{prefix}self_attn.o_proj.weight": rnd(D, NH * HD, g=g),
         f"{prefix}mlp.gate_proj.weight": rnd(I, D, g=g), f"{prefix}mlp.up_proj.weight": rnd(I, D, g=g),
         f"{prefix}mlp.down_proj.weight": rnd(D, I, g=g)}
    for n in norms:
        t[f"{prefix}{n}.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    return t


def eagle1_checkpoint(tmp_path, fmt: str = "bin", **cfg_extra):
    g = torch.Generator().manual_seed(0)
    sd = {"fc.weight": rnd(D, 2 * D, g=g), "fc.bias": 0.1 * torch.randn(D, generator=g),
          "embed_tokens.weight": rnd(V, D, g=g), **layer_tensors("layers.0.", D, g)}
    d = tmp_path / f"eagle1_{fmt}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(llama_config(**cfg_extra)))
    if fmt == "bin":
        torch.save({k: v.half() for k, v in sd.items()}, d / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.half() for k, v in sd.items()}, str(d / "model.safetensors"))
    return d, {k: v.half().float() for k, v in sd.items()}


def eagle3_checkpoint(tmp_path, **cfg_extra):
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(V, generator=g)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    sd = {"fc.weight": rnd(D, 3 * D, g=g), "norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
          "lm_head.weight": rnd(VD, D, g=g), "d2t": ids - torch.arange(VD), "t2d": t2d,
          **layer_tensors("midlayer.", 2 * D, g, ("input_layernorm", "hidden_norm", "post_attention_layernorm"))}
    d = tmp_path / "eagle3"
    d.mkdir()
    cfg = llama_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD, **cfg_extra)
    (d / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in sd.items()},
              str(d / "model.safetensors"))
    return d, {k: (v.to(torch.bfloat16).float() if v.is_floating_point() else v) for k, v in sd.items()}


# ---- the published forwards, transcribed -----------------------------------------------------------


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def ref_layer(sd, p, attn_in, residual):
    """cnets LlamaAttention + MLP over one sequence: attn_in [T, in], residual [T, D] -> [T, D]."""
    T = attn_in.shape[0]
    q = (attn_in @ sd[p + "self_attn.q_proj.weight"].T).view(T, NH, HD).transpose(0, 1)
    k = (attn_in @ sd[p + "self_attn.k_proj.weight"].T).view(T, NKV, HD).transpose(0, 1)
    v = (attn_in @ sd[p + "self_attn.v_proj.weight"].T).view(T, NKV, HD).transpose(0, 1)
    inv = 1.0 / (THETA ** (torch.arange(0, HD, 2).float() / HD))
    emb = torch.cat([torch.outer(torch.arange(T).float(), inv)] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(NH // NKV, 0), v.repeat_interleave(NH // NKV, 0)
    w = q @ k.transpose(1, 2) / math.sqrt(HD) + torch.full((T, T), float("-inf")).triu(1)
    o = (w.softmax(-1) @ v).transpose(0, 1).reshape(T, NH * HD) @ sd[p + "self_attn.o_proj.weight"].T
    x = residual + o
    h = rms(x, sd[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T))
    return x + mlp @ sd[p + "mlp.down_proj.weight"].T


def run_cached(head, emb, feat):
    head.init_cache(1, 64, torch.float32, "cpu")
    slot = head.cache.allocate()
    T = emb.shape[0]
    return head.forward_cached(emb, feat, torch.arange(T), [slot], [T])


# ---- tests ------------------------------------------------------------------------------------------


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


def test_written_heads_read_back(tmp_path):
    for method, (d, _) in (("eagle", eagle1_checkpoint(tmp_path)), ("eagle3", eagle3_checkpoint(tmp_path))):
        cfg, sd, _ = read_head(d)
        writer = write_eagle1 if method == "eagle" else write_eagle3
        out = writer(tmp_path / f"out_{method}", cfg, sd, dtype=torch.float32)
        cfg2, sd2, raw = read_head(out)
        assert cfg2 == cfg and raw["architectures"]
        for k in sd:
            assert torch.equal(sd[k], sd2[k]), k


def test_layouts_are_told_apart_and_wrong_ones_refused(tmp_path):
    d, sd = eagle1_checkpoint(tmp_path, "safetensors")
    with pytest.raises(ValueError, match="'eagle' layout but method='eagle3'"):
        read_head(d, method="eagle3")
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(llama_config()))
    save_file({"medusa_head.0.0.linear.weight": torch.zeros(2, 2)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="neither the EAGLE-1 layout.*nor the EAGLE-3"):
        detect_format(bad)
    save_file({k: v for k, v in sd.items()} | {"layers.0.input_layernorm.weight": torch.ones(D)},
              str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="input_layernorm"):
        read_head(bad)
    save_file({k: v for k, v in sd.items() if "o_proj" not in k}, str(bad / "model.safetensors"))
    with pytest.raises(KeyError, match="missing.*o_proj"):
        read_head(bad)


@pytest.mark.parametrize("method, field, value", [("eagle", "hidden_size", 48), ("eagle", "vocab_size", 640),
                                                  ("eagle3", "hidden_size", 48), ("eagle3", "vocab_size", 640)])
def test_a_checkpoint_that_does_not_fit_the_target_is_refused_naming_both(tmp_path, method, field, value):
    global D, V
    old = D, V
    try:
        D, V = (value, V) if field == "hidden_size" else (D, value)
        d, _ = eagle1_checkpoint(tmp_path) if method == "eagle" else eagle3_checkpoint(tmp_path)
    finally:
        D, V = old
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
