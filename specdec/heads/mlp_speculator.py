"""IBM's MLPSpeculator checkpoints (fms-extras ``MLPSpeculator``; vLLM ``mlp_speculator``), read into one
:class:`MLPSpeculatorConfig` + state dict in ``proposers.mlp_speculator.MLPSpeculator``'s names.

Layout (e.g. ``ibm-fms/*-accelerator`` on the HF hub): config.json with ``model_type: mlp_speculator``,
``n_predict`` (stages), ``emb_dim`` (the target's hidden size), ``inner_dim`` (0 = emb_dim),
``vocab_size``, ``tie_weights``, ``scale_input`` (and ``top_k_tokens_per_head``, ``n_candidates``, which
only a tree search would use); weights in ``model.safetensors`` or ``pytorch_model.bin``, keys optionally
under ``speculator.``:

- ``emb.{i}.weight`` [V, inner], ``proj.{i}.weight`` [inner, emb_dim if i == 0 else inner],
  ``head.{i}.weight`` [V, inner], ``ln.{i}.weight`` / ``ln.{i}.bias`` [inner], for i < n_predict;
- with ``tie_weights`` every stage shares emb/head/ln and stages >= 1 share proj.1, so a save may hold
  only one index of each group (safetensors drops duplicate tensors): any present index is accepted.

Knows nothing about modules or proposers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import torch

__all__ = ["MLPSpeculatorConfig", "check_mlp_speculator_fits", "read_mlp_speculator", "write_mlp_speculator"]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
GROUPS = ("emb", "proj", "head", "ln")


class MLPSpeculatorConfig(msgspec.Struct, kw_only=True, frozen=True):
    n_predict: int  # stages = most tokens drafted per step
    emb_dim: int  # the target's hidden size (the state the first stage reads)
    inner_dim: int  # width of the carried state (0 in a config.json means emb_dim)
    vocab_size: int
    tie_weights: bool = False
    scale_input: bool = False  # normalise the target's state (no weights) and divide by sqrt(2) first

    def __post_init__(self) -> None:
        if self.n_predict < 1 or self.inner_dim < 1:
            raise ValueError(f"MLPSpeculatorConfig: n_predict={self.n_predict} and inner_dim={self.inner_dim} must be >= 1")
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("MLPSpeculatorConfig: tie_weights needs n_predict >= 2 (IBM's design ties stages >= 1)")

    def hf_config(self) -> dict[str, Any]:
        return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                "n_predict": self.n_predict, "emb_dim": self.emb_dim, "inner_dim": self.inner_dim,
                "vocab_size": self.vocab_size, "tie_weights": self.tie_weights, "scale_input": self.scale_input,
                "top_k_tokens_per_head": [1] * self.n_predict, "n_candidates": 1}


def check_mlp_speculator_fits(cfg: MLPSpeculatorConfig, hidden_size: int, vocab_size: int, name: str) -> None:
    """Refuse a speculator that does not fit the target, naming both sizes."""
    if cfg.emb_dim != hidden_size:
        raise ValueError(f"MLPSpeculator {name} has emb_dim={cfg.emb_dim} (hidden size) but the target has "
                         f"hidden_size={hidden_size}; a speculator fits only the model it was trained on")
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"MLPSpeculator {name} has vocab_size={cfg.vocab_size} but the target has "
                         f"vocab_size={vocab_size}; a speculator fits only the model it was trained on")


def read_mlp_speculator(path: str | Path) -> tuple[MLPSpeculatorConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """-> (MLPSpeculatorConfig, a full state dict (every stage's keys), the raw config.json)."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"MLPSpeculator {str(p)!r}: no config.json; give the checkpoint directory")
    conf = json.loads((p / "config.json").read_text())
    f = next((p / n for n in WEIGHT_FILES if (p / n).is_file()), None)
    if f is None:
        raise FileNotFoundError(f"MLPSpeculator {str(p)!r}: none of {', '.join(WEIGHT_FILES)}")
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw = load_file(str(f))
    else:
        raw = torch.load(f, map_location="cpu", weights_only=True)
    sd = {k.removeprefix("speculator."): v for k, v in raw.items()}
    missing_conf = [k for k in ("n_predict", "emb_dim", "vocab_size") if k not in conf]
    if missing_conf:
        raise KeyError(f"MLPSpeculator {p}: config.json lacks {missing_conf}; is this an MLPSpeculator checkpoint?")
    emb_dim = int(conf["emb_dim"])
    cfg = MLPSpeculatorConfig(n_predict=int(conf["n_predict"]), emb_dim=emb_dim,
                              inner_dim=int(conf.get("inner_dim") or emb_dim), vocab_size=int(conf["vocab_size"]),
                              tie_weights=bool(conf.get("tie_weights", False)),
                              scale_input=bool(conf.get("scale_input", False)))
    have: dict[str, dict[int, dict[str, torch.Tensor]]] = {g: {} for g in GROUPS}
    for k, v in sd.items():
        if m := re.match(r"^(emb|proj|head|ln)\.(\d+)\.(weight|bias)$", k):
            have[m[1]].setdefault(int(m[2]), {})[m[3]] = v
    n, out = cfg.n_predict, {}
    for g in GROUPS:
        for i in range(n):
            src = i
            if cfg.tie_weights and i not in have[g]:  # shared: any stored copy of the tied group
                pool = [j for j in have[g] if (j >= 1) == (i >= 1)] if g == "proj" else list(have[g])
                src = min(pool) if pool else i
            if src not in have[g]:
                raise KeyError(f"MLPSpeculator {f}: missing {g}.{i}.* (has {sorted(sd)[:10]}...); is this an "
                               "MLPSpeculator checkpoint with n_predict=" + str(n) + "?")
            for kind, t in have[g][src].items():
                out[f"{g}.{i}.{kind}"] = t
    V, I = cfg.vocab_size, cfg.inner_dim
    shapes = {"emb": (V, I), "head": (V, I), "ln": (I,)}
    for k, t in out.items():
        g, i = k.split(".")[0], int(k.split(".")[1])
        want = (I, emb_dim if i == 0 else I) if g == "proj" else shapes[g]
        if tuple(t.shape) != want:
            raise ValueError(f"MLPSpeculator {f}: {k} is {tuple(t.shape)}, expected {list(want)} for emb_dim="
                             f"{emb_dim}, inner_dim={I}, vocab_size={V} (config.json)")
    return cfg, out, conf


def write_mlp_speculator(path: str | Path, cfg: MLPSpeculatorConfig, state_dict: dict[str, torch.Tensor],
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json + model.safetensors in the published layout (tied groups stored once, as HF does)."""
    from safetensors.torch import save_file

    keep = {}
    for k, v in state_dict.items():
        g, i = k.split(".")[0], int(k.split(".")[1])
        if cfg.tie_weights and i > (1 if g == "proj" else 0):
            continue
        keep[k] = v.detach().to(dtype).contiguous().cpu()
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    conf = cfg.hf_config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (p / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    save_file(keep, str(p / "model.safetensors"))
    return p
