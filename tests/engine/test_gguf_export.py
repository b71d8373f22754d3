"""The exported GGUFs hold exactly our engine's weights (specdec/engine/gguf_export.py)."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from specdec.engine.gguf_export import export_gguf, permute_rows, unpermute_rows  # noqa: E402


def test_permute_rows_is_undone_by_unpermute_rows():
    w = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)  # 3 heads of 4 rows
    p = permute_rows(w, 3)
    assert not torch.equal(p, w) and torch.equal(unpermute_rows(p, 3), w)
    # per head, rows [0, 1 | 2, 3] (two rotary halves) -> [0, 2, 1, 3]
    assert p[:4, 0].tolist() == [0.0, 6.0, 3.0, 9.0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_holds_the_loaded_weights_and_the_metadata(tmp_path, dtype):
    from safetensors.torch import load_file

    from specdec.engine.loader import DEFAULT_MODEL, _smollm2_gguf_path, resolve_model_dir

    src = _smollm2_gguf_path()
    sd = load_file(str(resolve_model_dir(DEFAULT_MODEL) / "model.safetensors"))  # what load_engine builds from
    out = export_gguf(src, sd, tmp_path / "m.gguf", dtype)
    s, r = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))

    skipped = {"general.file_type", "general.quantization_version"}
    for k, f in s.fields.items():
        if k.startswith("GGUF.") or k in skipped:
            continue
        assert k in r.fields and r.fields[k].contents() == f.contents(), k
    assert r.fields["general.file_type"].contents() == (0 if dtype == torch.float32 else 32)

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    hf = {tmap.get_name(k, try_suffixes=(".weight",)): k for k in sd}
    assert [t.name for t in r.tensors] == [t.name for t in s.tensors]
    for t in r.tensors:
        want = sd[hf[t.name]]
        if t.name.endswith("attn_q.weight"):
            want = permute_rows(want, 9)
        elif t.name.endswith("attn_k.weight"):
            want = permute_rows(want, 3)
        want = want.to(dtype)  # torch's rounding: what our engine's bf16 weights hold
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            got = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            assert dtype == torch.float32 or t.data.ndim == 1, f"{t.name}: a 2-D F32 tensor in the BF16 file"
            got = torch.from_numpy(np.array(t.data)).to(dtype)
        got = got.reshape(want.shape)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), t.name
    # the F32 values are the source's de-quantised Q4_1/Q8_0 values (so the q/k rows went back the right way)
    from gguf.quants import dequantize

    st = {t.name: t for t in s.tensors}
    for t in r.tensors[:10]:
        if dtype == torch.float32:
            assert np.array_equal(dequantize(st[t.name].data, st[t.name].tensor_type), np.asarray(t.data)), t.name
