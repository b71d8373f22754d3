"""The published EAGLE-1 head layout (SafeAILab/EAGLE ``cnets1.py``): config.json (a LlamaConfig with
num_hidden_layers=1) and weights ``fc.weight`` [D, 2D], ``fc.bias`` [D], ``layers.0.self_attn.{q,k,v,o}_proj
.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``, and
optionally ``embed_tokens.weight`` (a copy of the target's; the head uses the target's own).
Layer 0 has no ``input_layernorm`` in the published code; a checkpoint that has one is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.heads.common import hf_config, hf_shape, read_dir, take, write_dir
from specdec.heads.config import HeadConfig

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight")


def read_eagle1(path: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor], dict]:
    """-> (HeadConfig, state dict in ``EagleHead``'s names, the raw config.json)."""
    cfg, sd = read_dir(path)
    if "layers.0.input_layernorm.weight" in sd:
        raise ValueError(f"EAGLE-1 head {path}: has layers.0.input_layernorm.weight, which the published EAGLE-1 "
                         "layer does not have; this is not the EAGLE-1 layout")
    mapping = {f"layers.0.{k}": k for k in LAYER_KEYS} | {"fc.weight": "fc.weight"}
    if "fc.bias" in sd:
        mapping["fc.bias"] = "fc.bias"
    weights = take(sd, mapping, "EAGLE-1", str(path))
    hc = HeadConfig(method="eagle", fc_bias="fc.bias" in sd, **hf_shape(cfg))
    D = hc.hidden_size
    if tuple(weights["fc.weight"].shape) != (D, 2 * D):
        raise ValueError(f"EAGLE-1 head {path}: fc.weight is {tuple(weights['fc.weight'].shape)}, expected "
                         f"[{D}, {2 * D}] for hidden_size={D}")
    return hc, weights, cfg


def write_eagle1(path: str | Path, cfg: HeadConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, **extra_config) -> Path:
    """Write ``EagleHead.state_dict()`` in the published layout (weights cast to ``dtype``)."""
    out = {("layers.0." + k if k in LAYER_KEYS else k): v.to(dtype) for k, v in state_dict.items()
           if k in LAYER_KEYS or k.startswith("fc.")}
    conf = hf_config(cfg, "LlamaForCausalLM", bias=cfg.fc_bias, **extra_config)
    conf["torch_dtype"] = str(dtype).removeprefix("torch.")
    return write_dir(path, conf, out)
