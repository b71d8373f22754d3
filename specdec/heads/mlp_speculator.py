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

Target-tied checkpoints (ours, not IBM's): config.json's ``"specdec_target_tied": ["emb", "head"]`` says
those groups are the target's own input embedding and LM head (as ``experiments/train/mlp_speculator.py``
trains them: frozen copies), so the weight file holds proj and ln only (~113 MB -> ~1.3 MB for SmolLM2).
``load_mlp_speculator(path, target)`` fills them from the target engine (every stage the same matrix;
needs inner_dim == emb_dim). vLLM and fms-extras cannot load such a checkpoint: export the full layout.

The network, :class:`MLPSpeculator`, is here too (the maths: ``proposers/mlp_speculator.py``).
Knows nothing about proposers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import math

import msgspec
import torch
import torch.nn as nn

__all__ = ["MLPSpeculator", "MLPSpeculatorConfig", "TARGET_TIED", "check_mlp_speculator_fits",
           "load_mlp_speculator", "random_mlp_speculator", "read_mlp_speculator", "write_mlp_speculator"]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
GROUPS = ("emb", "proj", "head", "ln")
TARGET_TIED = "specdec_target_tied"  # config.json key: the groups that are the target's (module docstring)
TIED_GROUPS = ("emb", "head")  # emb = the target's input embedding, head = its LM head


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
    """-> (MLPSpeculatorConfig, a full state dict (every stage's keys, less the target-tied groups listed
    under config.json's ``TARGET_TIED``), the raw config.json)."""
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
    tied = conf.get(TARGET_TIED, [])
    if not isinstance(tied, list) or not set(tied) <= set(TIED_GROUPS):
        raise ValueError(f"MLPSpeculator {p}: config.json's {TARGET_TIED}={tied!r}; expected a list of "
                         f"{list(TIED_GROUPS)} (the groups that are the target's input embedding / LM head)")
    if tied and cfg.inner_dim != emb_dim:
        raise ValueError(f"MLPSpeculator {p}: {TARGET_TIED}={tied} needs inner_dim == emb_dim (the target's "
                         f"[vocab, hidden] tables), but inner_dim={cfg.inner_dim}, emb_dim={emb_dim}")
    have: dict[str, dict[int, dict[str, torch.Tensor]]] = {g: {} for g in GROUPS}
    for k, v in sd.items():
        if m := re.match(r"^(emb|proj|head|ln)\.(\d+)\.(weight|bias)$", k):
            have[m[1]].setdefault(int(m[2]), {})[m[3]] = v
    n, out = cfg.n_predict, {}
    for g in (g for g in GROUPS if g not in tied):
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
                         dtype: torch.dtype = torch.bfloat16, target_tied: bool = False) -> Path:
    """config.json + model.safetensors in the published layout (tied groups stored once, as HF does).
    ``target_tied``: emb and head ARE the target's input embedding and LM head (the caller vouches for it);
    leave them out and list them under ``TARGET_TIED`` (module docstring)."""
    from safetensors.torch import save_file

    tied = TIED_GROUPS if target_tied else ()
    if tied and cfg.inner_dim != cfg.emb_dim:
        raise ValueError(f"write_mlp_speculator: target_tied needs inner_dim == emb_dim, got inner_dim="
                         f"{cfg.inner_dim}, emb_dim={cfg.emb_dim}")
    keep = {}
    for k, v in state_dict.items():
        g, i = k.split(".")[0], int(k.split(".")[1])
        if g in tied:
            if not torch.equal(v, state_dict[f"{g}.0.weight"]):
                raise ValueError(f"write_mlp_speculator: target_tied, but {k} differs from {g}.0.weight; only "
                                 "the target's one table can be left out")
            continue
        if cfg.tie_weights and i > (1 if g == "proj" else 0):
            continue
        keep[k] = v.detach().to(dtype).contiguous().cpu()
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    conf = cfg.hf_config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    if tied:
        conf[TARGET_TIED] = list(tied)
    (p / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    save_file(keep, str(p / "model.safetensors"))
    return p


# ---------------------------------------------------------------------------------------------- network
class RMSLayerNorm(nn.Module):
    """IBM's LayerNormParameterized(use_mean=False, elementwise scale and shift), eps 1e-6."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """Module names = the checkpoint's: ``emb.{i}``, ``proj.{i}``, ``head.{i}``, ``ln.{i}``."""

    def __init__(self, cfg: MLPSpeculatorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n, E, I, V = cfg.n_predict, cfg.emb_dim, cfg.inner_dim, cfg.vocab_size
        if cfg.tie_weights:  # one emb/head/ln for every stage; proj.0 reads E wide, proj.1 is shared after it
            emb, head, ln, proj1 = nn.Embedding(V, I), nn.Linear(I, V, bias=False), RMSLayerNorm(I), nn.Linear(I, I, bias=False)
            self.emb, self.head, self.ln = (nn.ModuleList([m] * n) for m in (emb, head, ln))
            self.proj = nn.ModuleList([nn.Linear(E, I, bias=False)] + [proj1] * (n - 1))
        else:
            self.emb = nn.ModuleList(nn.Embedding(V, I) for _ in range(n))
            self.proj = nn.ModuleList(nn.Linear(E if i == 0 else I, I, bias=False) for i in range(n))
            self.head = nn.ModuleList(nn.Linear(I, V, bias=False) for _ in range(n))
            self.ln = nn.ModuleList(RMSLayerNorm(I) for _ in range(n))
        self.ln0 = RMSLayerNorm(E, affine=False) if cfg.scale_input else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (I / 2))
        self.act = nn.GELU()

    def first_state(self, h: torch.Tensor) -> torch.Tensor:
        """[b, E] the target's hidden state -> the state stage 0 reads."""
        return h if self.ln0 is None else self.ln0(h) / math.sqrt(2)

    def stage(self, i: int, state: torch.Tensor,  # [b, E or I]
              tokens: torch.Tensor,  # [b] int64 the previous token
              ) -> tuple[torch.Tensor, torch.Tensor]:  # new state [b, I], logits [b, V] float32
        s = self.proj[i](state) + self.emb[i](tokens) * (self.emb_weight / self.state_weight)
        s = self.act(self.ln[i](s))
        return s, self.head[i](s).float()


def random_mlp_speculator(cfg: MLPSpeculatorConfig, seed: int = 0) -> MLPSpeculator:
    """Seeded random weights (~1/sqrt(fan_in); LN scale ~1 + noise), for tests and debug runs."""
    g = torch.Generator().manual_seed(seed)
    m = MLPSpeculator(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():  # named_parameters visits a tied tensor once
            if name.startswith("ln."):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m.eval()


def load_mlp_speculator(path: str | Path, target=None) -> MLPSpeculator:
    """The speculator at ``path``; a target-tied one takes emb / head from ``target`` (a ModelEngine: its
    ``embed`` and ``compute_logits``, ``heads.common.target_embedding`` / ``target_lm_head``), refused
    naming both sizes when it does not fit."""
    cfg, sd, conf = read_mlp_speculator(path)
    tied = conf.get(TARGET_TIED, [])
    if tied:
        if target is None:
            raise ValueError(f"MLPSpeculator {path} is target-tied ({TARGET_TIED}={tied}: the target's input "
                             "embedding / LM head, not stored); load it with its target: load_mlp_speculator("
                             "path, target), as MLPSpeculatorProposer does")
        from specdec.heads.common import target_embedding, target_lm_head

        check_mlp_speculator_fits(cfg, target.hidden_size, target.vocab_size, str(path))
        for g in tied:
            w = (target_embedding if g == "emb" else target_lm_head)(target)
            if tuple(w.shape) != (cfg.vocab_size, cfg.inner_dim):  # the engine's sizes lied: say so anyway
                raise ValueError(f"MLPSpeculator {path}: the target's {g} table is {tuple(w.shape)}, expected "
                                 f"[{cfg.vocab_size}, {cfg.inner_dim}] (vocab_size, inner_dim of config.json)")
            sd.update({f"{g}.{i}.weight": w for i in range(cfg.n_predict)})
    m = MLPSpeculator(cfg)
    m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return m.eval()
