"""experiments/bench/step_phases.py on the debug run (tiny random model): the run completes and the timed pieces of
its speculative steps are printed (the figures are for experiments/LOG.md, not asserted here)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_times_the_pieces_of_a_debug_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "experiments.bench.step_phases", "debug=true",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "per speculative step (n=" in r.stdout
    assert "spec_decode_worker.SpecDecodeWorker._spec_step" in r.stdout
    assert "native.NativeEngine.forward" in r.stdout
