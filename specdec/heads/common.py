"""Reading and writing a head directory: ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``).

Knows nothing about which keys a format has (``eagle.py``, ``eagle3.py``) or about modules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor of the weight file) of a head directory."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"draft head {str(p)!r} is not a directory; give a folder with config.json and "
                                f"one of {', '.join(WEIGHT_FILES)}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"draft head {str(p)!r} has no config.json")
    cfg = json.loads((p / "config.json").read_text())
    for name in WEIGHT_FILES:
        f = p / name
        if f.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return cfg, load_file(str(f))
            return cfg, torch.load(f, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"draft head {str(p)!r} has none of {', '.join(WEIGHT_FILES)}")


def write_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(p / "model.safetensors"))
    return p


def hf_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The llama hyper-parameters of a head's config.json, in HeadConfig's names (transformers 4.x or 5.x)."""
    from specdec.engine.config import _rope_from_hf

    heads = cfg["num_attention_heads"]
    theta, scaling = _rope_from_hf(cfg)
    return dict(hidden_size=cfg["hidden_size"], num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate_size=cfg["intermediate_size"], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling, vocab_size=cfg["vocab_size"],
                max_position_embeddings=cfg.get("max_position_embeddings", 2048))


def hf_config(c, architecture: str, **extra: Any) -> dict[str, Any]:
    """A LlamaConfig-style config.json for HeadConfig ``c`` (what the EAGLE repos publish)."""
    d = {"architectures": [architecture], "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
         "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
         "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
         "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
         "rope_scaling": c.rope_scaling, "vocab_size": c.vocab_size,
         "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "bfloat16"}
    d.update(extra)
    return d


def take(sd: dict[str, torch.Tensor], mapping: dict[str, str], fmt: str, path: str) -> dict[str, torch.Tensor]:
    """Rename checkpoint keys to module keys; a missing key is an error naming the format."""
    missing = [k for k in mapping if k not in sd]
    if missing:
        raise KeyError(f"{fmt} head {path}: missing {missing} (has {sorted(sd)[:12]}...); is this a {fmt} checkpoint?")
    return {mapping[k]: sd[k] for k in mapping}


# ---------------------------------------------------------------------------------------------- one loader
REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = REPO / "checkpoints"  # the heads trained here, one folder each (with a CARD.md)
RANDOM_HEAD = "tiny-random-llama"  # seeded random heads shaped like the target: debug runs and smoke tests


def resolve_head_path(path: str | Path, who: str, hint: str) -> Path:
    """A head's folder or file: as given, else relative to the repository or to ``checkpoints/``."""
    p = Path(path).expanduser()
    if not p.exists() and not p.is_absolute():
        for base in (REPO, CHECKPOINTS):
            if (base / p).exists():
                return base / p
    if not p.exists():
        raise FileNotFoundError(f"{who}: no head at {str(path)!r} (looked there, under {REPO} and under "
                                f"{CHECKPOINTS}); {hint}, or give model={RANDOM_HEAD} for random heads")
    return p


def load_head_module(path: str | Path, who: str, load, random, hint: str):
    """The one way proposers get their head: ``random()`` for ``tiny-random-llama``, else
    ``load(resolved path)``. ``hint`` says how to make one (e.g. which training script exports it)."""
    if str(path) == RANDOM_HEAD:
        return random()
    return load(resolve_head_path(path, who, hint))


# ---------------------------------------------------------------------------------------------- target tables
def target_lm_head(target) -> torch.Tensor:
    """[V, D] the target's LM head in its dtype, through the engine's interface: compute_logits of the unit
    vector e_d is column d."""
    eye = torch.eye(target.hidden_size, dtype=target.dtype, device=target.device)
    return target.compute_logits(eye).T.to(target.dtype).contiguous()


def target_embedding(target) -> torch.Tensor:
    """[V, D] the target's input embedding, through the engine's interface (``embed`` of every id)."""
    return target.embed(torch.arange(target.vocab_size, device=target.device)).contiguous()


# ---------------------------------------------------------------------------------------------- LM head rows
class LMHeadRows:
    """Rows ``ids`` of the target's LM head, for heads that score with it (EAGLE-1, Medusa without their
    own): the weight is recovered through the engine's interface (compute_logits of the unit vector e_d is
    column d) and packed once for the CPU kernels when they are built. ``ids`` None = every row."""

    def __init__(self, target, ids: torch.Tensor | None, weight_dtype: torch.dtype | None = None) -> None:
        w = target_lm_head(target)  # [V, D]
        self.ids = ids  # [Vd] target id of each row; None = all
        self.weight = (w if ids is None else w[ids]).contiguous()  # [Vd, D]
        from specdec.engine.cpu.ops import NativeWeight, lib

        native = lib() is not None and target.device.type == "cpu"
        self._native = NativeWeight(self.weight.to(weight_dtype or self.weight.dtype).contiguous()) if native else None

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, Vd] float32."""
        if self._native is not None:
            from specdec.engine.cpu.ops import linear

            return linear(h.float().contiguous(), self._native)
        return (h.to(self.weight.dtype) @ self.weight.T).float()
