"""experiments/bench/vs_openvino.py needs OpenVINO GenAI in an environment of its own: without one it says how to make
it, and touches nothing else (the comparison itself runs by hand; its figures are in experiments/LOG.md)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_an_openvino_python_it_names_the_option_and_the_way_to_make_one():
    r = subprocess.run([sys.executable, "-m", "experiments.bench.vs_openvino"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--ov-python" in r.stderr and "openvino_genai" in r.stderr


def test_a_python_without_openvino_stops_the_run_with_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "experiments.bench.vs_openvino", "--ov-python", sys.executable,
                        "--lengths", "8", "--prompts", "1", "--decode-tokens", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "the OpenVINO worker stopped" in r.stderr
