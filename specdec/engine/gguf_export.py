"""Write the weights our engine runs as an F32 or BF16 GGUF that llama.cpp reads (``--llamacpp`` in the bench).

The values are the de-quantised ones in the converted model's safetensors (``loader.convert_gguf``), not a fresh
conversion: F32 holds them bit for bit; BF16 holds them rounded as ``torch.Tensor.to(torch.bfloat16)`` rounds
(round to nearest even, what our engine's bf16 weights are). 1-D tensors (the RMSNorm weights) stay F32 in both files,
as llama.cpp's convert script keeps them, but in the BF16 file they hold the bf16-rounded values, so both sides
multiply by the same numbers. The metadata (architecture, hyper-parameters, tokenizer, chat template) is copied
from the GGUF the model was converted from; only ``general.file_type`` changes.

llama.cpp stores a llama's q and k rows interleaved per head for its rotary embedding (the convert script's
``permute``); transformers undoes that on load, so the rows are permuted back here.

The files are cached inside the converted model's directory (keyed as the loader keys it), written to a temporary
name and renamed into place. This module knows nothing about llama.cpp's runtime: it only writes files.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["GGUF_TYPES", "export_gguf", "exported_gguf", "permute_rows", "unpermute_rows"]

GGUF_TYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}  # our dtype -> the GGUF tensor type written


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF [out, in] q/k rows -> llama.cpp's order: per head, the two rotary halves interleaved (convert_hf_to_gguf's
    ``permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of ``permute_rows``: llama.cpp's q/k rows -> HF's."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(src: str | Path, sd: dict[str, torch.Tensor], out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``sd`` (HF names, [out, in] fp32 tensors) to ``out`` as a GGUF of ``dtype``'s type, with ``src``'s
    metadata and tensor order. Every tensor of ``src`` must have its value in ``sd`` (a tied ``lm_head`` is the
    embedding, as in ``src``)."""
    import gguf

    if dtype not in GGUF_TYPES:
        raise ValueError(f"gguf_export: dtype={dtype} is not exportable; use one of {', '.join(map(str, GGUF_TYPES))}")
    src, out = Path(src), Path(out)
    r = gguf.GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    n_blocks = int(r.fields[f"{arch}.block_count"].contents())
    n_head = int(r.fields[f"{arch}.attention.head_count"].contents())
    n_kv = int(r.fields[f"{arch}.attention.head_count_kv"].contents()) if f"{arch}.attention.head_count_kv" in r.fields else n_head
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(archs[arch], n_blocks)
    by_gguf = {}
    for k in sd:
        name = tmap.get_name(k, try_suffixes=(".weight", ".bias"))
        if name is not None:
            by_gguf[name] = k
    missing = [t.name for t in r.tensors if t.name not in by_gguf]
    if missing:
        raise ValueError(f"gguf_export: {src.name}'s tensors {missing[:4]} have no value in the state dict "
                         f"({len(missing)} missing); is it the model converted from this GGUF?")

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type",
                                                    "general.quantization_version"):
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == torch.float32 else gguf.LlamaFileType.MOSTLY_BF16)
        for t in r.tensors:
            v = sd[by_gguf[t.name]].detach().to(torch.float32)
            if t.name.endswith("attn_q.weight"):
                v = permute_rows(v, n_head)
            elif t.name.endswith("attn_k.weight"):
                v = permute_rows(v, n_kv)
            if dtype == torch.bfloat16:
                v = v.to(torch.bfloat16)
                if v.dim() > 1:  # the bf16 bit patterns
                    w.add_tensor(t.name, v.contiguous().view(torch.int16).numpy().view(np.uint16),
                                 raw_dtype=gguf.GGMLQuantizationType.BF16)
                    continue
                v = v.to(torch.float32)  # exact: a bf16 value is an f32 value
            w.add_tensor(t.name, v.contiguous().numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def exported_gguf(model: str, dtype: torch.dtype = torch.float32) -> Path:
    """The cached ``dtype`` GGUF of ``model`` (a known name or a .gguf path: a model converted from a GGUF), written
    on first use beside its converted safetensors (~10 s and 540 MB for F32 of the default model)."""
    from safetensors.torch import load_file

    from specdec.engine.loader import _SOURCE_FILE, resolve_model_dir

    d = resolve_model_dir(model)
    src_file = d / _SOURCE_FILE if d is not None else None
    if src_file is None or not src_file.is_file():
        raise ValueError(f"gguf_export: model {model!r} was not converted from a GGUF, so there is no metadata "
                         "(tokenizer, hyper-parameters) to copy; pass the default model or a .gguf path")
    if dtype not in GGUF_TYPES:
        raise ValueError(f"gguf_export: dtype={dtype} is not exportable; use one of {', '.join(map(str, GGUF_TYPES))}")
    out = d / f"llamacpp-{GGUF_TYPES[dtype]}.gguf"
    if out.is_file():
        return out
    src = json.loads(src_file.read_text())["gguf"]
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return export_gguf(src, sd, out, dtype)
