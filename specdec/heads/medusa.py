"""The Medusa head family: the network (:class:`MedusaHeads`) and the layouts people publish, read into
one :class:`MedusaConfig` + state dict.

Medusa (Cai et al. 2024, FasterDecoding/Medusa ``medusa_model.py``): head i is ``num_layers`` ResBlocks
``x + SiLU(W x + b)`` on the target's last hidden state (after its final norm), then its own LM head
[V, D]. Head i drafts the token i+2 positions after that state (the target's LM head gives i+1).

Layouts read (the weight file inside a directory, or the file itself):

- FasterDecoding Medusa-1: ``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt`` holding the
  ``medusa_head`` ModuleList's state dict: ``{i}.{j}.linear.weight`` [D, D], ``{i}.{j}.linear.bias`` [D]
  for j < num_layers, ``{i}.{num_layers}.weight`` [V, D]; config.json ``medusa_num_heads``,
  ``medusa_num_layers`` (sizes come from the weights);
- the same keys under a ``medusa_lm_head.`` or ``medusa_head.`` prefix (Medusa-2 / whole-model saves;
  what :func:`write_medusa` writes), in ``model.safetensors`` / ``pytorch_model.bin``;
- vLLM's converted layout: ``blocks.{i}.layers.{j}.weight[/bias]``, ``lm_heads.{i}.weight``, optional
  ``token_map`` [Vt] (draft id -> target id) with ``truncated_vocab_size``, config ``num_heads``,
  ``num_hidden_layers``; ``original_lm_head: true`` = one LM head shared by every head.

An LM head may be absent when config.json says ``original_lm_head: true``: the heads then score with
the *target's* LM head (restricted to ``token_map`` when there is one). Trained heads here are written
that way (the LM head is the target's, frozen during training: the checkpoint stays ~1 MB per head).

Knows nothing about proposers (``proposers/medusa.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn as nn

__all__ = ["MedusaConfig", "MedusaHeads", "ResBlock", "check_medusa_fits", "load_medusa", "random_medusa",
           "read_medusa", "write_medusa"]

WEIGHT_FILES = ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt", "pytorch_model.bin")
_PREFIXES = ("medusa_lm_head.", "medusa_head.", "medusa_heads.", "")


class MedusaConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The shape of a set of Medusa heads (module names: see :class:`MedusaHeads`)."""

    num_heads: int  # H: drafts per step at most (head i drafts position i+1 after the pending token)
    num_layers: int = 1  # ResBlocks per head
    hidden_size: int  # D of the target's last hidden state
    vocab_size: int  # the target's vocabulary (what token ids index)
    own_lm_head: bool = True  # each head has its own LM head; False = score with the target's LM head
    shared_lm_head: bool = False  # one LM head for every head (vLLM's original_lm_head with weights)
    bias: bool = True  # the ResBlocks' linear layers have a bias (Medusa: yes; vLLM: medusa_fc_bias)
    draft_vocab_size: int | None = None  # rows scored per head when a token_map restricts the vocabulary
    # measured top-k accuracy of each head ([H][K], from train_medusa.py): builds the static tree
    topk_accuracy: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"MedusaConfig: num_heads={self.num_heads} must be >= 1 and num_layers="
                             f"{self.num_layers} >= 0")

    @property
    def lm_rows(self) -> int:
        """Rows of each head's LM head: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size


def check_medusa_fits(cfg: MedusaConfig, hidden_size: int, vocab_size: int, name: str) -> None:
    """Refuse heads that do not fit the target, naming both sizes."""
    if cfg.hidden_size != hidden_size:
        raise ValueError(f"Medusa head {name} has hidden_size={cfg.hidden_size} but the target has "
                         f"hidden_size={hidden_size}; a head fits only the model it was trained on")
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"Medusa head {name} has vocab_size={cfg.vocab_size} but the target has "
                         f"vocab_size={vocab_size}; a head fits only the model it was trained on")


def _load_weights(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """(config.json or {}, tensors, the weight file) of a directory or a single weight file."""
    p = path.expanduser()
    files = [p] if p.is_file() else [p / n for n in WEIGHT_FILES if (p / n).is_file()]
    if not files:
        raise FileNotFoundError(f"Medusa head {str(p)!r}: no weight file; give a directory with one of "
                                f"{', '.join(WEIGHT_FILES)} (and config.json), or the file itself")
    f = files[0]
    conf_path = (p if p.is_dir() else p.parent) / "config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(f))
    else:
        sd = torch.load(f, map_location="cpu", weights_only=True)
        sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    return conf, dict(sd), f


def _strip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the first prefix under which the heads' keys live (none for FasterDecoding's file)."""
    for pre in _PREFIXES:
        if pre and any(k.startswith(pre) for k in sd):
            return {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)} | (
                {"token_map": sd["token_map"]} if "token_map" in sd else {})
    return sd


def read_medusa(path: str | Path) -> tuple[MedusaConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """-> (MedusaConfig, state dict in ``MedusaHeads``' names, the raw config.json)."""
    conf, raw, f = _load_weights(Path(path))
    sd = _strip(raw)
    out: dict[str, torch.Tensor] = {}
    fc = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")  # FasterDecoding / Medusa-2
    lm = re.compile(r"^(\d+)\.(\d+)\.weight$")
    vfc = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")  # vLLM
    vlm = re.compile(r"^lm_heads\.(\d+)\.weight$")
    blocks: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    heads: dict[int, torch.Tensor] = {}
    lm_index: dict[int, int] = {}
    for k, v in sd.items():
        if m := fc.match(k) or vfc.match(k):
            blocks.setdefault((int(m[1]), int(m[2])), {})[m[3]] = v
        elif m := lm.match(k):
            heads[int(m[1])] = v
            lm_index[int(m[1])] = int(m[2])
        elif m := vlm.match(k):
            heads[int(m[1])] = v
    if not blocks:
        raise KeyError(f"Medusa head {f}: no ResBlock weights ({{i}}.{{j}}.linear.weight or "
                       f"blocks.{{i}}.layers.{{j}}.weight) among {sorted(sd)[:8]}...; is this a Medusa checkpoint?")
    H = 1 + max(i for i, _ in blocks)
    L = 1 + max(j for _, j in blocks)
    n_heads = conf.get("medusa_num_heads", conf.get("num_heads", H))
    n_layers = conf.get("medusa_num_layers", conf.get("num_hidden_layers", L))
    if (n_heads, n_layers) != (H, L) or len(blocks) != H * L:
        raise ValueError(f"Medusa head {f}: config.json says {n_heads} heads x {n_layers} ResBlocks but the weights "
                         f"hold {len(blocks)} ResBlocks over heads 0..{H - 1}, layers 0..{L - 1}")
    if any(lm_index[i] != L for i in lm_index):
        raise ValueError(f"Medusa head {f}: LM head indices {sorted(set(lm_index.values()))} != num_layers={L}")
    D = blocks[(0, 0)]["weight"].shape[1]
    bias = "bias" in blocks[(0, 0)]
    for (i, j), b in blocks.items():
        if tuple(b["weight"].shape) != (D, D) or ("bias" in b) != bias:
            raise ValueError(f"Medusa head {f}: ResBlock ({i}, {j}) has weight {tuple(b['weight'].shape)}"
                             f"{' and a bias' if 'bias' in b else ''}; expected [{D}, {D}] like ResBlock (0, 0)")
        out[f"heads.{i}.{j}.linear.weight"] = b["weight"]
        if bias:
            out[f"heads.{i}.{j}.linear.bias"] = b["bias"]
    token_map = sd.get("token_map")
    shared = bool(conf.get("original_lm_head", False))
    own = bool(heads)
    if own:
        want = [0] if shared else list(range(H))
        if sorted(heads) != want and not (shared and 0 in heads):
            raise ValueError(f"Medusa head {f}: LM heads for heads {sorted(heads)}; expected {want}")
        rows = heads[0].shape[0]
        for i in ([0] if shared else range(H)):
            if tuple(heads[i].shape) != (rows, D):
                raise ValueError(f"Medusa head {f}: LM head {i} is {tuple(heads[i].shape)}, expected [{rows}, {D}]")
            out[f"lm_heads.{i}.weight"] = heads[i]
    elif not shared:
        raise KeyError(f"Medusa head {f}: no LM head weights ({{i}}.{L}.weight or lm_heads.{{i}}.weight) and "
                       "config.json does not say original_lm_head: true (score with the target's LM head)")
    if token_map is not None:
        token_map = token_map.long().reshape(-1)
        out["token_map"] = token_map
    draft = int(token_map.numel()) if token_map is not None else None
    if own and token_map is None:
        vocab = heads[0].shape[0]
        if conf.get("vocab_size") not in (None, vocab):
            raise ValueError(f"Medusa head {f}: LM heads have {vocab} rows but config.json says vocab_size="
                             f"{conf['vocab_size']}; a reduced vocabulary needs a token_map")
    else:
        vocab = conf.get("vocab_size")
        if vocab is None:
            raise KeyError(f"Medusa head {f}: config.json has no vocab_size (needed with a token_map or the "
                           "target's LM head)")
        if own and heads[0].shape[0] != (draft or vocab):
            raise ValueError(f"Medusa head {f}: LM heads have {heads[0].shape[0]} rows, token_map {draft}")
    if token_map is not None and int(token_map.max()) >= vocab:
        raise ValueError(f"Medusa head {f}: token_map holds id {int(token_map.max())} >= vocab_size={vocab}")
    cfg = MedusaConfig(num_heads=H, num_layers=L, hidden_size=D, vocab_size=int(vocab), own_lm_head=own,
                       shared_lm_head=own and shared, bias=bias, draft_vocab_size=draft,
                       topk_accuracy=conf.get("topk_accuracy"))
    return cfg, out, conf


def write_medusa(path: str | Path, cfg: MedusaConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, **extra_config: Any) -> Path:
    """Write ``MedusaHeads.state_dict()`` as ``model.safetensors`` with ``medusa_lm_head.{i}.{j}.linear.*``
    and ``medusa_lm_head.{i}.{L}.weight`` keys (+ ``token_map``) and a config.json naming the sizes."""
    from safetensors.torch import save_file

    L = cfg.num_layers
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        if m := re.match(r"^heads\.(\d+)\.(\d+)\.linear\.(weight|bias)$", k):
            tensors[f"medusa_lm_head.{m[1]}.{m[2]}.linear.{m[3]}"] = v.to(dtype)
        elif m := re.match(r"^lm_heads\.(\d+)\.weight$", k):
            tensors[f"medusa_lm_head.{m[1]}.{L}.weight"] = v.to(dtype)
        elif k == "token_map":
            tensors[k] = v.long()
    conf = {"architectures": ["MedusaModel"], "model_type": "medusa", "medusa_num_heads": cfg.num_heads,
            "medusa_num_layers": L, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "original_lm_head": (not cfg.own_lm_head) or cfg.shared_lm_head,
            "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.draft_vocab_size:
        conf["truncated_vocab_size"] = cfg.draft_vocab_size
    if cfg.topk_accuracy:
        conf["topk_accuracy"] = cfg.topk_accuracy
    conf.update(extra_config)
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(p / "model.safetensors"))
    return p


# ---------------------------------------------------------------------------------------------- network
class ResBlock(nn.Module):
    """x + SiLU(W x + b) (Medusa's ResBlock; W is zero-initialised, so a fresh head = the LM head)."""

    def __init__(self, hidden_size: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """H heads: ``heads.{i}`` = num_layers ResBlocks [+ the LM head as ``heads.{i}.{num_layers}`` in the
    checkpoint, kept here as ``lm_heads.{i}``]; ``token_map`` [Vd] = target id of each draft id."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(D, cfg.bias) for _ in range(cfg.num_layers)])
                                   for _ in range(cfg.num_heads))
        n_lm = 0 if not cfg.own_lm_head else (1 if cfg.shared_lm_head else cfg.num_heads)
        self.lm_heads = nn.ModuleList(nn.Linear(D, cfg.lm_rows, bias=False) for _ in range(n_lm))
        if cfg.draft_vocab_size:  # [Vd] target id of each draft id
            self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size))
        else:
            self.token_map: torch.Tensor | None = None

    def features(self, h: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """[N, D] target hidden states -> [n, N, D] the first n heads' ResBlock outputs."""
        return torch.stack([blk(h) for blk in self.heads[: n or len(self.heads)]])

    def logits(self, h: torch.Tensor, n: int | None = None,
               target_lm: torch.Tensor | None = None,  # [Vd, D] the target's LM head rows (no own LM head)
               ) -> torch.Tensor:  # [n, N, Vd] float32 over the draft vocabulary (token_map, or all V)
        x = self.features(h, n)
        if not self.lm_heads:
            if target_lm is None:
                raise ValueError("MedusaHeads.logits: these heads use the target's LM head; pass target_lm")
            return (x @ target_lm.T).float()
        return torch.stack([self.lm_heads[0 if len(self.lm_heads) == 1 else i](x[i]) for i in range(len(x))]).float()


def random_medusa(cfg: MedusaConfig, seed: int = 0, scale: float = 1.0) -> MedusaHeads:
    """Seeded random heads (weights ~ scale / sqrt(D)), for tests and debug runs."""
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return heads.eval()


def load_medusa(path: str | Path) -> MedusaHeads:
    """Medusa heads from a published layout (float32, eval mode)."""
    cfg, sd, _ = read_medusa(path)
    heads = MedusaHeads(cfg)
    heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    return heads.eval()
