"""Draft heads, one module per family holding its network and its checkpoint reader/writer in the layouts
people publish: ``eagle.py`` (EAGLE-1), ``eagle3.py``, ``medusa.py``, ``mlp_speculator.py``; ``layers.py``
has the decoder layer EAGLE-1 and EAGLE-3 share, ``common.py`` the one loader every proposer uses (paths,
``checkpoints/``, the tiny-random fallback). A reader returns (config, state dict in the module's names, raw config);
``read_head`` tells the EAGLE formats apart by their keys. Knows nothing about proposers.
"""

from __future__ import annotations

from pathlib import Path

from specdec.heads.config import HeadConfig, eagle3_layers
from specdec.heads.eagle import EagleHead, read_eagle1, write_eagle1
from specdec.heads.eagle3 import Eagle3Head, read_eagle3, write_eagle3

__all__ = ["EagleHead", "Eagle3Head", "HeadConfig", "build_head", "eagle3_layers", "detect_format", "load_head",
           "read_head", "read_eagle1", "read_eagle3", "write_eagle1", "write_eagle3"]


def detect_format(path: str | Path) -> str:
    """'eagle' or 'eagle3', from the weight keys (config.json files of both are plain LlamaConfigs)."""
    from specdec.heads.common import read_dir

    _, sd = read_dir(path)
    if any(k.startswith("midlayer.") for k in sd):
        return "eagle3"
    if "fc.weight" in sd and any(k.startswith("layers.0.") for k in sd):
        return "eagle"
    raise ValueError(f"draft head {path}: keys {sorted(sd)[:8]}... match neither the EAGLE-1 layout (fc.*, layers.0.*) "
                     "nor the EAGLE-3 one (fc, midlayer.*, norm, lm_head, d2t, t2d)")


def read_head(path: str | Path, method: str | None = None):
    """(HeadConfig, state dict, raw config.json) of an EAGLE-1 or EAGLE-3 head directory."""
    fmt = detect_format(path)
    if method is not None and method != fmt:
        raise ValueError(f"draft head {path} is in the {fmt!r} layout but method={method!r} was asked for; "
                         f"use method='{fmt}'")
    return read_eagle1(path) if fmt == "eagle" else read_eagle3(path)


def build_head(cfg: HeadConfig):
    return EagleHead(cfg) if cfg.method == "eagle" else Eagle3Head(cfg)


def load_head(path: str | Path, method: str | None = None):
    """An EAGLE-1 or EAGLE-3 head from a directory in the published layout (float32, eval mode). Attaches
    ``freq_ids`` (target ids by training frequency) when ``draft_vocab.safetensors`` sits beside it."""
    cfg, sd, _ = read_head(path, method)
    head = build_head(cfg)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    vocab = Path(path).expanduser() / "draft_vocab.safetensors"
    if vocab.is_file():
        from safetensors.torch import load_file

        head.freq_ids = load_file(str(vocab))["ids"].long()
    return head.eval()
