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
