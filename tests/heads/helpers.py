"""Helpers the head tests import by name (no tests here; the ``target`` fixture is in conftest.py).

- EAGLE-1 / EAGLE-3 checkpoints written key for key as the EAGLE repositories publish them
  (SafeAILab/EAGLE: ``cnets1.py`` for EAGLE-1, ``cnets.py`` for EAGLE-3): :func:`eagle1_checkpoint`,
  :func:`eagle3_checkpoint`, and an independent plain-torch transcription of the published forward
  (:func:`ref_layer`: explicit repeat_kv, rotate_half, additive causal mask) to check loaded heads against.
  The checkpoint builders read ``D`` and ``V`` from this module when called (a test may patch them to
  write a head that does not fit the target).
- :func:`rand` (a fresh seed per call) and :func:`write_json` for the Medusa and MLPSpeculator layouts.
"""

import json
import math

import torch

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


# ---- Medusa, MLPSpeculator ---------------------------------------------------------------------------


def rand(*shape, seed=[0]):
    """[*shape] scaled by 1/sqrt(last dim), from the next seed of a counter shared by every caller."""
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) / shape[-1] ** 0.5


def write_json(path, obj):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(obj))
