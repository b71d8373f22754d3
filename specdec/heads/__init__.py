"""Draft-head checkpoints in the layouts people publish: EAGLE-1 and EAGLE-3 (Medusa and MLPSpeculator
loaders belong here too). A reader returns (HeadConfig, state dict in the module's names, raw config);
``read_head`` tells the formats apart by their keys. Knows nothing about modules or proposers.
"""

from __future__ import annotations

from pathlib import Path

from specdec.heads.config import HeadConfig, eagle3_layers
from specdec.heads.eagle import read_eagle1, write_eagle1
from specdec.heads.eagle3 import read_eagle3, write_eagle3

__all__ = ["HeadConfig", "eagle3_layers", "detect_format", "read_head", "read_eagle1", "read_eagle3",
           "write_eagle1", "write_eagle3"]


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
