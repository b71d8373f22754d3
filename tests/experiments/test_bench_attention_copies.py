"""experiments/bench/attention_copies.py on the tiny model: a bf16 model's attention over its bf16 copies of K and V
against fp32 copies, in one process (its figures are for experiments/LOG.md, not asserted here); a build without
AVX512_BF16 has nothing to compare and says so."""

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.engine.cpu import build, ops

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(ops.lib() is None, reason=f"native kernels unavailable: {build.status()}")


def test_times_both_attentions_on_every_case_or_says_why_not():
    r = subprocess.run([sys.executable, "-m", "experiments.bench.attention_copies", "--model", "tiny-random-llama",
                        "--context", "24", "--reps", "1", "--prefill", "16"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if ops.lib().sd_isa() < 2:
        assert r.returncode != 0 and "keeps fp32 copies already" in r.stderr
        return
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| M=") or line.startswith("| B=")
            or line.startswith("| P=")]
    assert len(rows) == 13 and "read rate" in r.stdout  # 8 M cases, 4 B cases, the prompt
