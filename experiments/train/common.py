"""What the training scripts share: their Hydra configs (``compose``, ``options``), the feature shards
(``load_data``), the reduced vocabulary (``vocab_by_frequency``, ``reduced_vocab``, ``coverage``), the target's
tables (``target_parts``), the input scale (``feature_scale``), the schedule (``cosine_lr``), checkpoint I/O
(``save_atomic``, ``read_checkpoint``, ``load_tensors``: never unpickling code) and logging through specdec's
W&B logger (``TrainLogger``).

Knows nothing about any head's network, loss or export layout: those live in each script.

Feature shards (experiments/distill/prefill.py writes them): ``manifest.json`` lists ``shard_NNNNN.pt`` files,
each holding ``prompt_indices``, ``sources``, ``tokens`` (prompt + response ids per sequence),
``num_prompt_tokens``, ``hidden`` [sum(n-1), D] fp16 (the target's last layer after the final norm, row t = the
state after token t) and ``aux`` [sum(n-1), 3D] fp16 (EAGLE-3's three layers) or None. A manifest entry must
name a file inside its directory (``shard_path``), and every ``.pt`` is read with ``weights_only=True``: a
shard or checkpoint from someone else can hold tensors and plain containers, never code to run.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Mapping

import torch

from specdec.experiment.loggers import WandbLogger

CONF = Path(__file__).resolve().parent / "conf"  # one yaml per script: python -m experiments.train.<name> key=value


# ---------------------------------------------------------------------------------------------- config


def compose(name: str, overrides: list[str] | tuple[str, ...] = ()):
    """The config ``python -m experiments.train.<name> <overrides>`` runs with, without running it (tests and
    notebooks call each script's ``run`` with it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name=name, overrides=list(overrides))


def options(cfg: Any, script: str, choices: Mapping[str, tuple] | None = None) -> SimpleNamespace:
    """A script's config (a DictConfig or a plain mapping) as attributes, ``args.lr``: every key must be set
    (``???`` in the yaml marks the required ones) and each key of ``choices`` must hold one of its values."""
    from omegaconf import DictConfig, OmegaConf

    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    d = {k: v for k, v in d.items() if k != "hydra"}
    missing = [k for k, v in d.items() if v == "???"]
    if missing:
        raise ValueError(f"{script}: {', '.join(f'{k}=...' for k in missing)} required "
                         f"(python -m experiments.train.{script} --help lists the keys)")
    for k, allowed in (choices or {}).items():
        if d.get(k) not in allowed:
            raise ValueError(f"{script}: {k}={d.get(k)!r}; choose one of {', '.join(map(str, allowed))}")
    return SimpleNamespace(**d)


def ints(v: Any) -> list[int]:
    """A list of ints from a Hydra value: ``[3,4]``, ``3`` or the old comma form ``"3,4"``."""
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    if isinstance(v, int):
        return [v]
    return [int(x) for x in str(v).split(",") if x]


def comma_list(v: Any) -> str:
    """A comma-separated string from a Hydra value: ``[writing,math]`` or ``"writing,math"``."""
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


# ---------------------------------------------------------------------------------------------- data


def shard_index(name: str) -> int:
    """The response shard a feature shard was built from: ``shard_00107.pt`` -> 107."""
    m = re.fullmatch(r"shard_(\d+)\.pt", name)
    if m is None:
        raise ValueError(f"feature shard {name!r} is not named shard_NNNNN.pt; first_shard cannot place it")
    return int(m.group(1))


def shard_path(data_dir: Path, name: Any) -> Path:
    """``data_dir / name`` for a manifest entry, refused unless it names a file directly inside ``data_dir``:
    an absolute path, ``..`` or a sub-folder would let a manifest from elsewhere read any file."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"{data_dir / 'manifest.json'}: shard entry {name!r} is not a plain file name inside "
                         f"{data_dir} (absolute paths, '..' and sub-folders are refused); list shard_NNNNN.pt names")
    return data_dir / name


def load_tensors(path: Path, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and plain containers only. A file that
    would unpickle anything else (an object whose ``__reduce__`` runs code) is refused, naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: refused to load: it holds pickled objects other than tensors and plain "
                         f"containers, which could run code when unpickled (torch.load weights_only=True said: "
                         f"{str(e).splitlines()[0]}); load only files this project wrote, or rebuild it") from None


def load_data(data_dir: Path, need_aux: bool, max_seqs: int | None = None, first_shard: int = 0) -> list[dict]:
    """Sequences from the shards: tokens [n] int64, n_prompt, hidden [n-1, D] fp16, aux [n-1, 3D] fp16.
    The feature tensors are memory-mapped (``torch.load(mmap=True)``): 2M tokens with EAGLE-3's layers are
    ~15 GB, more than this machine's memory, and the page cache holds what the batches touch.
    ``first_shard``: leave out the shards built from response shards before that index (a stage that trains
    on newly generated data only; the held-out split is then those shards' own)."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    for sh in manifest["shards"]:  # every entry checked before any is read
        shard_path(data_dir, sh["file"])
    shards = [sh for sh in manifest["shards"] if not first_shard or shard_index(sh["file"]) >= first_shard]
    if not shards:
        have = [sh["file"] for sh in manifest["shards"]]
        raise ValueError(f"first_shard={first_shard} leaves no shard of {data_dir} (it has "
                         f"{have[0] if have else 'none'} .. {have[-1] if have else ''}); lower it")
    seqs = []
    for sh in shards:
        path = shard_path(data_dir, sh["file"])
        d = load_tensors(path, mmap=True)
        if need_aux and d["aux"] is None:
            raise ValueError(f"{path} has no EAGLE-3 layers; regenerate without --no-aux")
        r = 0
        for pid, toks, n_p, src in zip(d["prompt_indices"], d["tokens"], d["num_prompt_tokens"], d["sources"]):
            n = len(toks)
            seqs.append({"prompt_id": int(pid), "tokens": torch.tensor(toks), "n_prompt": n_p, "source": src,
                         "hidden": d["hidden"][r:r + n - 1],
                         "aux": d["aux"][r:r + n - 1] if need_aux else None})
            r += n - 1
        if max_seqs and len(seqs) >= max_seqs:
            break
    return seqs[:max_seqs] if max_seqs else seqs


def vocab_by_frequency(seqs: list[dict], vocab_size: int) -> torch.Tensor:
    """Target ids of the response tokens, most frequent first ([vocab_size] int64); ids never seen follow
    in id order so the list is complete."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["tokens"][s["n_prompt"]:], minlength=vocab_size)
    return torch.argsort(-counts, stable=True)


def reduced_vocab(freq: torch.Tensor, n: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n most frequent ids of ``freq`` as (ids [n] ascending, in_vocab [V] bool, target -> reduced index
    [V] int64, -1 outside)."""
    r_ids = freq[:n].sort().values
    in_vocab = torch.zeros(vocab_size, dtype=torch.bool)
    in_vocab[r_ids] = True
    t2r = torch.full((vocab_size,), -1, dtype=torch.long)
    t2r[r_ids] = torch.arange(len(r_ids))
    return r_ids, in_vocab, t2r


def coverage(seqs: list[dict], in_vocab: torch.Tensor) -> float:
    """The share of the sequences' response tokens inside the reduced vocabulary (``in_vocab`` [V] bool)."""
    n = sum(len(s["tokens"]) - s["n_prompt"] for s in seqs)
    return sum(int(in_vocab[s["tokens"][s["n_prompt"]:]].sum()) for s in seqs) / max(n, 1)


def feature_scale(seqs: list[dict], key: str, n: int = 200) -> torch.Tensor:
    """Per-dimension RMS of the input features over (up to) n sequences, [F] float32."""
    x = torch.cat([s[key][:256].float() for s in seqs[:n]])
    return x.pow(2).mean(0).sqrt().clamp(min=1e-3)


# ---------------------------------------------------------------------------------------------- target


def target_parts(model: str):
    """(target ModelConfig, embedding [V, D] fp32, final norm weight [D], LM head [V, D] fp32) without building
    an engine."""
    from safetensors import safe_open

    from specdec.engine.config import ModelConfig
    from specdec.engine.loader import resolve_model_dir

    d = resolve_model_dir(model)
    if d is None and model == "tiny-random-llama":  # the tests' built-in model (seed 0): no files on disk
        from specdec.engine.tiny import tiny_config, tiny_random_weights

        cfg = tiny_config()
        w = tiny_random_weights(cfg, 0)
        emb, norm = w["model.embed_tokens.weight"].float(), w["model.norm.weight"].float()
        return cfg, emb, norm, w.get("lm_head.weight", emb).float()
    cfg = ModelConfig.from_hf_config(json.loads((d / "config.json").read_text()))
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight").float()
        norm = f.get_tensor("model.norm.weight").float()
        lm = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else emb
    return cfg, emb, norm, lm


# ---------------------------------------------------------------------------------------------- schedule


def cosine_lr(step: int, lr: float, warmup: int, total_steps: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from lr to 0 at ``total_steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return lr * 0.5 * (1 + math.cos(math.pi * done))


# ---------------------------------------------------------------------------------------------- checkpoints


def save_atomic(obj: dict, path: Path) -> None:
    """torch.save through a .tmp file, so a kill mid-write leaves the previous file whole."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def read_checkpoint(path: Path) -> dict:
    """A run checkpoint (ckpt.pt) or warm start (train_state.pt) as saved: tensors, RNG states, the config
    (plain containers: ``load_tensors`` refuses anything that would unpickle code)."""
    return load_tensors(path)


# ---------------------------------------------------------------------------------------------- logging


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TrainLogger(WandbLogger):
    """specdec's W&B logger for a training run: offline unless WANDB_MODE says otherwise, files under the run
    directory, one W&B run per run directory and method (id ``<out name>-<method>``, so ``resume=true``
    continues it), scalars per optimizer step. A W&B failure warns once and training goes on without it;
    ``enabled=False`` logs nothing."""

    def __init__(self, out: Path, config: dict, method: str, enabled: bool = True) -> None:
        mode = os.environ.get("WANDB_MODE", "offline")
        super().__init__(project="specdec", mode=mode if mode in ("offline", "online", "disabled") else "offline",
                         name=out.name, job_type="train")
        if enabled:
            with _environ(WANDB_RUN_ID=f"{out.name}-{method}", WANDB_RESUME="allow"):
                self.start(config, out)

    def log(self, data: dict, step: int) -> None:
        self._guard("log", lambda: self.run.log(data, step=step))
