"""The bench's llama.cpp comparison (specdec/engine/bench_llamacpp.py): same values -> same greedy token, every case
in the table; and without the extra, the bench says how to install it and runs the rest."""

import sys

import pytest

from specdec.engine import bench, bench_llamacpp


def test_without_llama_cpp_the_bench_prints_the_hint_and_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ModuleNotFoundError
    monkeypatch.setattr(sys, "argv", ["bench", "--model", "tiny-random-llama", "--context", "24", "--reps", "1",
                                      "--llamacpp"])
    bench.main()
    out = capsys.readouterr().out
    assert out.count(bench_llamacpp.INSTALL_HINT) == 1 and 'pip install -e ".[llamacpp]"' in out
    assert "M=33" in out and "B=16" in out and "prefill" in out  # our rows still ran


def test_comparison_table_has_every_case():
    ours = {"M": {m: (2.0 * m, 2.0 * m) for m in bench.M_CASES}, "prefill": (9.0, 9.5), "argmax": 7}
    theirs = {"M": {m: (1.0 * m, 1.0 * m) for m in bench.M_CASES}, "prefill": (3.0, 3.0), "argmax": 7}
    t = bench_llamacpp.comparison_table(ours, theirs, 32)
    for m in bench.M_CASES:
        assert f"| M={m} |" in t
    assert "| prefill 32 |" in t and "| 3.00 |" in t and "(same)" in t  # prefill ratio 9 / 3


@pytest.mark.slow
def test_llama_cpp_greedy_token_equals_ours_on_the_f32_gguf():
    if (why := bench_llamacpp.available()) is not None:
        pytest.skip(why)
    ours = bench.bench(bench.DEFAULT_MODEL, context=32, reps=1, dtype="float32")
    theirs = bench.bench_llamacpp(bench.DEFAULT_MODEL, context=32, reps=1, dtype="float32", threads=2)
    assert theirs["type"] == "F32" and set(theirs["M"]) == set(bench.M_CASES)
    assert all(lo > 0 for lo, _ in theirs["M"].values()) and theirs["prefill"][0] > 0
    assert theirs["argmax"] == ours["argmax"], (ours["argmax"], theirs["argmax"])
    table = bench_llamacpp.comparison_table(ours, theirs, 32)
    assert all(f"| M={m} |" in table for m in bench.M_CASES) and "(same)" in table
