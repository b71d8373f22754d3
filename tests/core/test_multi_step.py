"""Multi-step decoding (specdec/core/multi_step.py, num_scheduler_steps = N) on the tiny model: the same
outputs as N = 1, plain, n-gram and an EAGLE tree, for a batch whose requests end mid-block in every way
(max_tokens, EOS, a stop token id, a stop string, a seeded random row), through the plain worker's fast loop and the
generic per-step loop; an abort and a failing request mid-way harm no neighbour and leak no slot; the
scheduler is consulted once per block.

Expected outputs are never hand-written: they come from the N = 1 run of the same engine, and the stop
token / stop string / EOS are picked out of the continuation that run produced."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.core.llm_engine import LLMEngine
from specdec.datamodel.sampling_params import SamplingParams
from specdec.engine.testing import rand_tokens

SPECS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3},
         "eagle_tree": {"method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3, "scorer": "tree",
                        "tree_depth": 3, "tree_topk": 2, "tree_budget": 6}}
PROMPTS = [{"prompt_token_ids": [40, 41, 42, 43] * 3}, {"prompt_token_ids": rand_tokens(9, seed=2)},
           {"prompt_token_ids": rand_tokens(6, seed=5)}, {"prompt_token_ids": [50, 51, 52, 50, 51]},
           {"prompt_token_ids": rand_tokens(12, seed=1)}]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make(spec: str, n: int, eos: int | None = None) -> LLM:
    llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=96, speculative_config=SPECS[spec],
              num_scheduler_steps=n)
    llm.llm_engine.eos_token_id = eos  # the tiny model never samples its tokenizer's EOS: pick one it does emit
    return llm


def outputs(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             o.error) for o in outs]


@pytest.fixture(scope="module")
def clean() -> dict[str, list[int]]:
    """Each prompt's greedy continuation (24 tokens, no stop), plain; the n-gram worker's is the same."""
    llm = make("plain", 1)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    return {"toks": [o.outputs[0].token_ids for o in outs], "text": [o.outputs[0].text for o in outs]}


def mixed_params(clean, with_processors: bool) -> list[SamplingParams]:
    """One way to end mid-block per request. ``with_processors``: two rows that keep the fast loop out."""
    toks, text = clean["toks"], clean["text"]
    stop = next(text[2][i:i + 2] for i in range(3, 12) if text[2][i:i + 2] not in text[2][:i + 1])
    params = [
        SamplingParams(max_tokens=21, **GREEDY),
        SamplingParams(max_tokens=5, **GREEDY),  # ends inside the first block of 8
        SamplingParams(max_tokens=24, stop=[stop], **GREEDY),  # a stop string mid-block: the replay cuts
        SamplingParams(max_tokens=24, stop_token_ids=[toks[3][6]], **GREEDY),
        SamplingParams(max_tokens=19, temperature=0.9, seed=7, ignore_eos=True),  # seeded: its own draws
    ]
    if with_processors:
        params[0] = SamplingParams(max_tokens=21, logprobs=2, **GREEDY)
        params[3] = SamplingParams(max_tokens=24, stop_token_ids=[toks[3][6]], repetition_penalty=1.3, **GREEDY)
    return params


@pytest.mark.parametrize("with_processors", [False, True], ids=["fast_loop", "generic_loop"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_every_n_gives_the_outputs_of_n1(spec, with_processors, clean, one_thread):
    params = mixed_params(clean, with_processors)
    ref = None
    for n in (1, 4, 8):
        llm = make(spec, n)
        got = outputs(llm.generate(PROMPTS, params, use_tqdm=False))
        assert llm.engine.num_free_slots() == llm.engine.num_slots  # the rows that ended mid-block were freed
        if ref is None:
            ref = got
            assert len(got[1][0]) == 5 and got[2][2] == "stop"
            assert with_processors or got[3][2] == "stop"  # a penalty changes the continuation the id came from
        assert got == ref, f"{spec} N={n}"
    if with_processors:
        assert ref[0][0] == clean["toks"][0][:21]


@pytest.mark.parametrize("spec", list(SPECS))
def test_eos_mid_block_stops_at_it(spec, clean, one_thread):
    eos = clean["toks"][0][10]
    ref = None
    for n in (1, 8):
        llm = make(spec, n, eos=eos)
        params = SamplingParams(temperature=0.0, max_tokens=24)
        got = outputs(llm.generate(PROMPTS[:3], params, use_tqdm=False))
        ref = ref or got
        assert got == ref and got[0][0][-1] == eos and len(got[0][0]) <= 11


def test_fast_loop_equals_the_per_step_loop(clean, one_thread):
    """PlainWorker.decode_steps (no Python per row per step, the engine's LogitStats argmax) == execute_model
    per step: the same tokens and cumulative logprobs."""
    params = mixed_params(clean, with_processors=False)
    fast = make("plain", 8)
    slow = make("plain", 8)
    slow.worker.decode_steps = lambda *args: None  # declines: the engine loops execute_model
    a, b = fast.generate(PROMPTS, params, use_tqdm=False), slow.generate(PROMPTS, params, use_tqdm=False)
    assert outputs(a) == outputs(b)
    for x, y in zip(a, b):
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("spec", list(SPECS))
def test_abort_mid_way_leaves_the_others_as_a_clean_run(spec, clean, one_thread):
    llm = make(spec, 8)
    params = SamplingParams(max_tokens=24, **GREEDY)
    ids = [llm.add_request(p, params) for p in PROMPTS[:3]]
    outs = {o.request_id: o for o in llm.step() + llm.step()}  # the prefill, one block of 8
    llm.abort(ids[1])
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    outs.update({o.request_id: o for o in llm.step()})
    assert outs[ids[1]].outputs[0].finish_reason == "abort"
    assert [outs[i].outputs[0].token_ids for i in (ids[0], ids[2])] == [clean["toks"][0], clean["toks"][2]]
    assert llm.engine.num_free_slots() == llm.engine.num_slots


class Boom(RuntimeError):
    pass


def poison_one_mid_block(llm: LLM, slots, clean_toks: list[list[int]], monkeypatch, after: int) -> None:
    """Prompts 0-2 greedy; the target's forward raises once prompt 1 (the poison) holds ``after`` output tokens,
    inside the first block: it must end alone with the error, the others equal a clean run, no slot leaks.
    ``slots``: the worker's slot table (the plain worker's)."""
    params = SamplingParams(max_tokens=24, **GREEDY)
    ids = [llm.add_request(p, params) for p in PROMPTS[:3]]
    outs = {o.request_id: o for o in llm.step()}  # the prefill
    group = llm.llm_engine.groups[ids[1]]
    slot = slots.slot_of[group.first_seq.seq_id]
    limit = group.first_seq.get_prompt_len() + after
    real = llm.engine.forward

    def forward(batch):
        if slot in batch.slots and llm.engine.seq_len(slot) >= limit:
            raise Boom("poison mid-block")
        return real(batch)

    monkeypatch.setattr(llm.engine, "forward", forward)
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    outs.update({o.request_id: o for o in llm.step()})
    bad = outs[ids[1]]
    assert bad.outputs[0].finish_reason == "error" and "Boom: poison mid-block" in bad.error
    assert [outs[i].outputs[0].token_ids for i in (ids[0], ids[2])] == [clean_toks[0], clean_toks[2]]
    assert llm.engine.num_free_slots() == llm.engine.num_slots


@pytest.mark.parametrize("spec", list(SPECS))
def test_a_request_failing_mid_block_stops_alone(spec, clean, one_thread, monkeypatch):
    """The target's forward raises once the poison (prompt 1) holds 4 output tokens, the 4th step of the
    first block: the block is rolled back, the poison isolated, the others equal a clean run."""
    llm = make(spec, 8)
    slots = (llm.worker if spec == "plain" else llm.worker.plain).slots
    poison_one_mid_block(llm, slots, clean["toks"], monkeypatch, after=4)


def test_the_scheduler_is_consulted_once_per_block(one_thread, monkeypatch):
    llm = make("plain", 4)
    calls = []
    real = llm.llm_engine.scheduler.schedule
    monkeypatch.setattr(llm.llm_engine.scheduler, "schedule", lambda: calls.append(1) or real())
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=17, **GREEDY), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [17, 17]
    assert len(calls) == 1 + 4  # the prefill (1 token), then 16 tokens in blocks of 4


def test_num_scheduler_steps_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="num_scheduler_steps=0"):
        LLM("tiny-random-llama", num_scheduler_steps=0)
    with pytest.raises(TypeError, match="num_scheduler_steps"):
        LLMEngine(None, None, max_num_seqs=1, max_model_len=8, eos_token_id=None, num_scheduler_steps=2.0)


def test_the_server_core_streams_every_token_in_bursts(clean, one_thread):
    """specdec.v1.core.EngineCore over EngineArgs(num_scheduler_steps=8): each step's new tokens of a request,
    concatenated, are its final tokens; a block delivers up to 8 at once."""
    import time as _time

    from specdec.entrypoints.engine_args import EngineArgs
    from specdec.v1.core import EngineCore
    from specdec.v1.protocol import EngineCoreRequest

    core = EngineCore(EngineArgs(model="tiny-random-llama", max_num_seqs=2, max_model_len=96, num_scheduler_steps=8))
    assert core.engine.num_scheduler_steps == 8
    params = SamplingParams(max_tokens=20, **GREEDY)
    core.add_request(EngineCoreRequest("a", PROMPTS[0]["prompt_token_ids"], params, _time.time()))
    got, bursts = [], []
    while core.has_work():
        for out in core.step().outputs:
            got += out.new_token_ids
            bursts.append(len(out.new_token_ids))
    assert got == clean["toks"][0][:20] and max(bursts) == 8


def test_engine_args_carry_num_scheduler_steps_to_the_llm():
    import argparse

    from specdec.entrypoints.engine_args import EngineArgs

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--num-scheduler-steps", "4"])
    args = EngineArgs.from_cli_args(ns)
    assert args.num_scheduler_steps == 4 and args.llm_kwargs()["num_scheduler_steps"] == 4


def test_the_serve_config_key_reaches_the_engine_args():
    from specdec.serve import engine_args_from, split_config
    from tests.serve.conftest import composed

    serve_cfg, run_cfg = split_config(composed("model=tiny", "serve.num_scheduler_steps=8"))
    assert engine_args_from(run_cfg, False, serve_cfg.num_scheduler_steps).num_scheduler_steps == 8
    assert split_config(composed("model=tiny"))[0].num_scheduler_steps == 1  # conf/serve/default.yaml


@pytest.mark.parametrize("spec", ["plain", "ngram"])
def test_guided_requests_give_the_outputs_of_n1(spec, one_thread):
    """Grammar matchers advance inside the block with the sequence and end at the EOS their grammar asks for."""
    from specdec.datamodel.sampling_params import GuidedDecodingParams as G

    guides = [G(regex=r"[a-c]{2,4}-\d{2}( \((home|work)\))?"), G(choice=["yes", "no", "maybe so"]),
              G(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" [a-z]')]
    params = [SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=g) for g in guides]
    params.append(SamplingParams(max_tokens=24, **GREEDY))
    ref = None
    for n in (1, 8):
        llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=96, speculative_config=SPECS[spec],
                  num_scheduler_steps=n)
        got = outputs(llm.generate(PROMPTS[:4], params, use_tqdm=False))
        ref = ref or got
        assert got == ref and [o[4] for o in got] == [None] * 4
        assert llm.engine.num_free_slots() == llm.engine.num_slots


def test_seeded_sampling_and_a_worker_that_overrides_its_step(one_thread):
    """Seeded random rows (top_p too) draw the same tokens in the fast loop as step by step; a PlainWorker
    subclass that changes execute_model (tests/core/test_llm_engine.FaultyWorker: it raises at every decode
    step with the poison in the batch) is still called at every step of a block, and only the poison stops."""
    from tests.core import test_llm_engine as t

    def engine(n: int, worker_cls=t.PlainWorker) -> LLMEngine:
        e = t.make(worker_cls=worker_cls)
        e.num_scheduler_steps = n
        return e

    def run(e, prompts, params) -> list:
        ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs = t.run(e)
        return [outs[i] for i in ids]

    want = [t.tokens(o) for o in run(engine(1), t.GOOD, t.GOOD_PARAMS)]
    assert [t.tokens(o) for o in run(engine(8), t.GOOD, t.GOOD_PARAMS)] == want
    faulty = engine(8, type("Faulty", (t.FaultyWorker,), {"fail_in": "decode"}))
    outs = run(faulty, t.MIXED, t.MIXED_PARAMS)
    assert outs[1].outputs[0].finish_reason == "error" and "Boom: poison in the batch" in outs[1].error
    assert [t.tokens(o) for o in outs[:1] + outs[2:]] == want
    assert t.free_slots(faulty) == faulty.worker.engine.num_slots


def test_the_overhead_bench_runs_and_finds_the_same_tokens(one_thread, capsys):
    from experiments.bench.overhead import main

    rows = main(["--model", "tiny-random-llama", "--steps", "1,4", "--batches", "1,2", "--tokens", "6", "--reps", "1"])
    assert len(rows) == 2 * 2 * 2 and all(r["same"] for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["overhead_ratio"] == 1.0 for r in rows if r["steps"] == 1)
    assert "read rate" in capsys.readouterr().out


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=512)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["plain", "ngram"])
def test_smollm2_greedy_identical_at_n8(spec, smol):
    """The real model (its own EOS, a stop string), a ragged batch of 4: N = 8 gives N = 1's outputs."""
    llm = smol.with_speculation(SPECS[spec])
    prompts = [{"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": q}])} for q in
               ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                "Explain photosynthesis in one sentence.")]
    params = [SamplingParams(temperature=0, max_tokens=m, stop=s) for m, s in
              ((40, []), (48, ["\n"]), (33, []), (64, [","]))]
    got = {}
    for n in (1, 8):
        llm.llm_engine.num_scheduler_steps = n
        got[n] = outputs(llm.generate(prompts, params, use_tqdm=False))
    assert got[8] == got[1] and any(o[2] == "stop" for o in got[1])  # something ended mid-way, not by length
    assert llm.engine.num_free_slots() == llm.engine.num_slots
