"""Our top-level `kernels` package shares its import name with Hugging Face's hub-kernels package, which
transformers probes for. With ours importable, transformers must not think hub kernels are installed and
must still build and run a model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import kernels
assert hasattr(kernels, "get_ops"), kernels.__file__   # ours, not a namespace package or the hub one
import torch, transformers
from transformers.utils import import_utils
assert not import_utils.is_kernels_available(), "transformers mistook specdec's kernels for hub kernels"
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
