"""EngineCore and its clients on the tiny model: streamed deltas add up to LLM.generate's tokens, aborts free
slots, utilities answer, speculative stats are counted per step, a killed core process is reported."""

import os
import signal
import time

import pytest

from specdec import LLM, SamplingParams
from specdec.entrypoints.engine_args import EngineArgs
from specdec.v1.client import EngineDeadError, InprocClient, MPClient
from specdec.v1.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10], [1, 2, 3]]


def drain(client, ids, timeout=60.0):
    toks = {i: [] for i in ids}
    done = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids) and time.monotonic() < deadline:
        outs = client.get_output(timeout=1.0)
        for o in outs.outputs:
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o
    return toks, done


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_inproc_deltas_equal_generate(spec):
    args = EngineArgs(model="tiny-random-llama", max_num_seqs=4, max_model_len=128, speculative_config=spec)
    client = InprocClient(args)
    for i, p in enumerate(PROMPTS):
        client.add_request(EngineCoreRequest(f"r{i}", p, GREEDY, time.time()))
    toks, done = drain(client, [f"r{i}" for i in range(3)])
    ref = args.create_llm().generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [toks[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in ref]
    assert all(d.finish_reason is FinishReason.LENGTH and d.metrics is not None for d in done.values())
    s = client.call_utility("get_stats")
    assert s["speculative"] == (spec is not None) and s["num_running_reqs"] == 0
    if spec:
        assert s["spec_decode"]["num_draft_tokens"] > 0


def test_inproc_abort_and_step_stats():
    args = EngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=128,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    client = InprocClient(args)
    client.add_request(EngineCoreRequest("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                                         time.time()))
    client.add_request(EngineCoreRequest("b", PROMPTS[0], GREEDY, time.time()))
    seen_spec = False
    for _ in range(3):
        out = client.get_output(timeout=1.0)
        st = out.scheduler_stats
        seen_spec |= st.num_draft_tokens > 0
        assert st.num_accepted_tokens == sum(st.num_accepted_tokens_per_pos)
    assert seen_spec
    client.abort_requests(["a"])
    toks, done = drain(client, ["a", "b"])
    assert done["a"].finish_reason is FinishReason.ABORT and done["b"].finish_reason is FinishReason.LENGTH
    llm = client.core.llm
    assert llm.engine.num_free_slots() == llm.engine.num_slots


def test_bad_request_reaches_core_as_an_error_output():
    client = InprocClient(EngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=64))
    client.add_request(EngineCoreRequest("bad", [1, 10**9], GREEDY, time.time()))
    _, done = drain(client, ["bad"])
    assert done["bad"].finish_reason is FinishReason.ERROR and "out of range" in done["bad"].error
    with pytest.raises(ValueError, match="no utility"):
        client.call_utility("nope")


def test_process_core_streams_and_reports_being_killed():
    args = EngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=128)
    client = MPClient(args, startup_timeout_s=120)
    try:
        client.add_request(EngineCoreRequest("r0", PROMPTS[0], GREEDY, time.time()))
        toks, done = drain(client, ["r0"])
        ref = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128).generate(
            {"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
        assert toks["r0"] == ref.outputs[0].token_ids and done["r0"].finish_reason is FinishReason.LENGTH
        assert client.call_utility("ping") == "pong"
        os.kill(client.pid, signal.SIGKILL)
        client.proc.wait(10)
        assert not client.is_alive()
        with pytest.raises(EngineDeadError):
            client.get_output(timeout=5)
        with pytest.raises(EngineDeadError):
            client.add_request(EngineCoreRequest("r1", PROMPTS[0], GREEDY, time.time()))
    finally:
        client.shutdown()


def test_reset_and_profile_utilities():
    client = InprocClient(EngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=64))
    client.add_request(EngineCoreRequest("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                         time.time()))
    assert "profiling the next 2 steps" in client.call_utility("profile", 2)
    client.get_output(timeout=1.0)
    client.get_output(timeout=1.0)
    assert client.call_utility("reset") == 1  # "a" was still running: aborted
    assert client.call_utility("get_stats")["num_running_reqs"] == 0
    llm = client.core.llm
    assert llm.engine.num_free_slots() == llm.engine.num_slots


def test_top_level_api_and_cli_args():
    import argparse

    import specdec

    for name in ("LLM", "SamplingParams", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs",
                 "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt"):
        assert getattr(specdec, name).__name__ == name and name in specdec.__all__
    parser = specdec.EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "tiny-random-llama", "--max-num-seqs", "3",
                            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    args = specdec.EngineArgs.from_cli_args(ns)
    assert args.max_num_seqs == 3 and args.speculative_config["method"] == "ngram" and args.is_speculative
    assert not specdec.EngineArgs(model="x").is_speculative
    a = specdec.AsyncEngineArgs.from_cli_args(specdec.AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
                                              .parse_args(["--no-multiprocess"]))
    assert a.multiprocess is False


def test_a_guided_request_compiles_beside_the_step_loop():
    """xgrammar's compile time grows steeply with the grammar (60,000 choices took ~2 minutes, during which
    the core stepped nobody). Now a guided request waits in the core's compile thread while the others decode,
    is admitted when its grammar is ready, and one aborted while compiling is never admitted. The real compile,
    held back by a gate so the test controls how long it takes."""
    import threading

    from specdec.datamodel.sampling_params import GuidedDecodingParams
    from specdec.v1.core import EngineCore

    core = EngineCore(EngineArgs(model="tiny-random-llama", max_num_seqs=4, max_model_len=64))
    compiler = core.engine._grammars
    real, gate = compiler.compile, threading.Event()
    compiler.compile = lambda params: (gate.wait(60), real(params))[1]
    guided = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    core.add_request(EngineCoreRequest("g", [1, 2, 3], guided, time.time()))
    core.add_request(EngineCoreRequest("gone", [1, 2, 3], guided, time.time()))
    core.add_request(EngineCoreRequest("p", [4, 5, 6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                       time.time()))
    core.abort_requests(["gone"])
    done: dict[str, EngineCoreOutputs] = {}
    for _ in range(50):  # the plain request runs to its end while the grammar is held
        core.admit_compiled()
        if not core.has_work():
            break
        done |= {o.request_id: o for o in core.step().outputs if o.finish_reason is not None}
    assert "p" in done and core.compiling and "g" not in core.engine.groups
    gate.set()
    deadline = time.monotonic() + 60
    while "g" not in done and time.monotonic() < deadline:
        core.admit_compiled()
        if core.has_work():
            done |= {o.request_id: o for o in core.step().outputs if o.finish_reason is not None}
        else:
            time.sleep(0.005)
    assert "g" in done and done["g"].error is None and "gone" not in done and not core.compiling
    assert core.num_aborted == 1 and not core.engine.groups
