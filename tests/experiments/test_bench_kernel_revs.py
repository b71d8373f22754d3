"""experiments/bench/kernel_revs.py on the tiny model: a git revision's kernels against the working tree's in
one process (its figures are for experiments/LOG.md, not asserted here), and the refusal of a bad revision."""

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.engine.cpu import build, ops

ROOT = Path(__file__).resolve().parents[2]
MODULE = "experiments.bench.kernel_revs"  # run from ROOT: python -m
pytestmark = pytest.mark.skipif(ops.lib() is None, reason=f"native kernels unavailable: {build.status()}")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULE, "--model", "tiny-random-llama", "--context", "24",
                           "--reps", "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_compares_a_revision_with_the_working_tree_on_every_case():
    r = _run("--rev", "HEAD")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "read rate" in r.stdout and "M=33" in r.stdout and "B=16" in r.stdout
    # the same source on both sides: every case's logits bit-identical
    assert "same logits" in r.stdout and "| NO" not in r.stdout and r.stdout.count("| yes") == 12


def test_a_missing_revision_is_refused_naming_it():
    r = _run("--rev", "no-such-rev-xyz")
    assert r.returncode != 0 and "--rev 'no-such-rev-xyz': git show failed" in r.stderr


def test_a_source_file_is_the_baseline(tmp_path):
    variant = tmp_path / "variant.cpp"
    variant.write_text(build.SOURCE.read_text())
    r = _run("--source", str(variant))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{variant} ms" in r.stdout and "M=7" in r.stdout


def test_a_missing_source_file_is_refused_naming_it(tmp_path):
    r = _run("--source", str(tmp_path / "nope.cpp"))
    assert r.returncode != 0 and "nope.cpp'" in r.stderr and "no such file" in r.stderr
