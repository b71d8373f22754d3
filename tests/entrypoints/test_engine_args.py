"""EngineArgs: dtype auto by default; the server's engine core leaves a core to the front end (#43 item 3)."""

import argparse

from specdec.entrypoints.engine_args import AsyncEngineArgs, EngineArgs, torch_threads


def test_offline_engine_takes_every_core_and_the_server_core_leaves_one(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert torch_threads() == 4
    assert EngineArgs().llm_kwargs()["num_threads"] is None  # LLM: torch's default
    assert AsyncEngineArgs().llm_kwargs()["num_threads"] == 3  # the engine core: all but one
    assert AsyncEngineArgs(reserve_cores=0).llm_kwargs()["num_threads"] is None
    assert AsyncEngineArgs(multiprocess=False).llm_kwargs()["num_threads"] is None  # the caller's process: untouched
    assert AsyncEngineArgs(num_threads=2).llm_kwargs()["num_threads"] == 2  # asked for: as asked
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert AsyncEngineArgs().llm_kwargs()["num_threads"] == 1  # never below one
    assert "reserve_cores" not in EngineArgs().llm_kwargs()  # folded in: LLM does not take it


def test_cli_flag_and_defaults():
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--reserve-cores", "2"])
    assert EngineArgs.from_cli_args(ns).reserve_cores == 2
    assert EngineArgs().dtype == "auto" and AsyncEngineArgs().reserve_cores == 1


def test_importing_specdec_sets_a_short_openmp_spin_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads it: ``import specdec`` (which imports
    no torch) sets a short spin first (engine/cpu/threads.py has the measurements), unless the environment already
    says otherwise."""
    import os
    import subprocess
    import sys

    code = ("import sys, os, specdec; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["passive", "10000", "False"]
    env["OMP_WAIT_POLICY"] = "active"
    env["GOMP_SPINCOUNT"] = "0"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split()[:2] == ["active", "0"]
