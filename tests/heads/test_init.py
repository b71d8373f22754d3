"""specdec/heads/__init__.py: the EAGLE format dispatch. ``detect_format`` / ``read_head`` tell the
EAGLE-1 and EAGLE-3 layouts apart by their keys and refuse the wrong one (or neither), and heads written
by ``write_eagle1`` / ``write_eagle3`` read back exactly.
"""

import json

import pytest
import torch

from specdec.heads import detect_format, read_head, write_eagle1, write_eagle3
from tests.heads.helpers import D, eagle1_checkpoint, eagle3_checkpoint, llama_config


def test_written_heads_read_back(tmp_path):
    for method, (d, _) in (("eagle", eagle1_checkpoint(tmp_path)), ("eagle3", eagle3_checkpoint(tmp_path))):
        cfg, sd, _ = read_head(d)
        writer = write_eagle1 if method == "eagle" else write_eagle3
        out = writer(tmp_path / f"out_{method}", cfg, sd, dtype=torch.float32)
        cfg2, sd2, raw = read_head(out)
        assert cfg2 == cfg and raw["architectures"]
        for k in sd:
            assert torch.equal(sd[k], sd2[k]), k


def test_layouts_are_told_apart_and_wrong_ones_refused(tmp_path):
    d, sd = eagle1_checkpoint(tmp_path, "safetensors")
    with pytest.raises(ValueError, match="'eagle' layout but method='eagle3'"):
        read_head(d, method="eagle3")
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(llama_config()))
    save_file({"medusa_head.0.0.linear.weight": torch.zeros(2, 2)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="neither the EAGLE-1 layout.*nor the EAGLE-3"):
        detect_format(bad)
    save_file({k: v for k, v in sd.items()} | {"layers.0.input_layernorm.weight": torch.ones(D)},
              str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="input_layernorm"):
        read_head(bad)
    save_file({k: v for k, v in sd.items() if "o_proj" not in k}, str(bad / "model.safetensors"))
    with pytest.raises(KeyError, match="missing.*o_proj"):
        read_head(bad)
