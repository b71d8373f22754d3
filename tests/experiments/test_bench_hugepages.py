"""experiments/bench/hugepages.py on the tiny model: both engines load, every case is timed on both and printed (its
figures are for experiments/LOG.md, not asserted here)."""

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.engine.cpu import build, ops

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(ops.lib() is None, reason=f"native kernels unavailable: {build.status()}")


def test_prints_the_read_rates_and_every_case():
    r = subprocess.run([sys.executable, "-m", "experiments.bench.hugepages", "--model", "tiny-random-llama",
                        "--dtype", "float32", "--context", "20", "--reps", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "read rate" in r.stdout and "AnonHugePages" in r.stdout
    for case in ("M=1 ", "M=33", "B=4 ", "B=16"):
        assert f"  {case}" in r.stdout, r.stdout
