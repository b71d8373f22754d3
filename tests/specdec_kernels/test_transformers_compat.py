"""Our ops package was a top-level `kernels`, the import name of Hugging Face's hub-kernels package, which transformers
(5.25 on) requires and imports with every model: from the repository root ours shadowed it and no model loaded. With
ours importable from the root (`specdec_kernels`), transformers must build and run a model, and a `kernels` import must
not be ours."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib.util, os
import specdec_kernels
assert hasattr(specdec_kernels, "get_ops"), specdec_kernels.__file__
spec = importlib.util.find_spec("kernels")  # the hub package where installed, never a folder of this repository
assert spec is None or not os.path.realpath(spec.origin or "").startswith(os.path.realpath(os.getcwd())), spec
import torch, transformers
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3]])).logits
assert logits.shape == (1, 3, 64), logits.shape
print("OK")
"""


def test_transformers_loads_model_with_our_kernels_importable():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # our kernels package, from ROOT
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
