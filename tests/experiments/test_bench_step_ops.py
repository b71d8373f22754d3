"""experiments/bench/step_ops.py on small shapes and a tiny random head: both cases run and print (the figures are
for experiments/LOG.md, not asserted here)."""

import subprocess
import sys
from pathlib import Path

from tests.heads.helpers import eagle3_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODULE = "experiments.bench.step_ops"  # run from ROOT: python -m


def test_prints_the_argmax_and_rope_cases(tmp_path):
    head, _ = eagle3_checkpoint(tmp_path)
    r = subprocess.run([sys.executable, "-m", MODULE, "--rows", "3", "--vocab", "512", "--head", str(head), "--calls", "2",
                        "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "read rate" in r.stdout and "argmax [1, 3, 512]" in r.stdout and "_rope_rows" in r.stdout
