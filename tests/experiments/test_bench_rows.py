"""experiments/bench/rows.py on the tiny model: every context and the LM-head rows are timed and printed (its
figures are for experiments/LOG.md, not asserted here)."""

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.engine.cpu import build, ops

ROOT = Path(__file__).resolve().parents[2]
MODULE = "experiments.bench.rows"  # run from ROOT: python -m
pytestmark = pytest.mark.skipif(ops.lib() is None, reason=f"native kernels unavailable: {build.status()}")


@pytest.mark.parametrize("rows", [7, 3])  # the default tree, and a chain
def test_prints_each_context_and_the_lm_head_rows(rows):
    r = subprocess.run([sys.executable, "-m", MODULE, "--model", "tiny-random-llama", "--contexts", "4,20",
                        "--rows", str(rows), "--reps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "read rate" in r.stdout
    lines = r.stdout.splitlines()
    assert any(line.strip().startswith("4 |") for line in lines) and any(line.strip().startswith("20 |") for line in lines)
    assert f" {rows + 1}: " in r.stdout  # the LM head up to rows + 1
