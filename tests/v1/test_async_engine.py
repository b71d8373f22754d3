"""AsyncLLMEngine on the tiny model: greedy equality with LLM.generate (plain and n-gram), stop strings and
n in the front end, cancelling aborts in the core, a killed core process fails the waiters, restart serves."""

import asyncio
import os
import signal

import pytest

from specdec import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from specdec.v1.client import EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello there", "abcabcabc", "why?"]


def args(multiprocess=False, **kw):
    return AsyncEngineArgs(model="tiny-random-llama", max_num_seqs=4, max_model_len=128, multiprocess=multiprocess, **kw)


async def collect(engine, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_greedy_equals_generate_and_streams_grow(spec):
    async def main():
        engine = await AsyncLLMEngine.from_engine_args(args(speculative_config=spec))
        try:
            res = await asyncio.gather(*[collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)])
        finally:
            await engine.shutdown_async()
        return res

    res = asyncio.run(main())
    ref = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, speculative_config=spec).generate(
        PROMPTS, GREEDY, use_tqdm=False)
    for outs, r in zip(res, ref):
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.outputs[0].token_ids == r.outputs[0].token_ids and final.outputs[0].text == r.outputs[0].text
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens)  # cumulative
        assert final.latency.ttft > 0 and final.metrics.model_execute_time > 0


def test_stop_string_n_and_cancel_abort():
    async def main():
        engine = await AsyncLLMEngine.from_engine_args(args())
        try:
            ascii_ids = engine.tokenizer("abcdefghijklmnop", add_special_tokens=False)["input_ids"]
            base = dict(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=ascii_ids)
            full = (await collect(engine, "hello", SamplingParams(**base), "full"))[-1].outputs[0]
            i = next(i for i in range(2, 10) if full.text[i:i + 2] not in full.text[:i + 1])
            stop = full.text[i:i + 2]
            cut = await collect(engine, "hello", SamplingParams(**base, stop=[stop]), "cut")
            # streamed text never runs ahead of the final text
            assert all(cut[-1].outputs[0].text.startswith(o.outputs[0].text) for o in cut)
            assert cut[-1].outputs[0].text == full.text[:i] and cut[-1].outputs[0].stop_reason == stop
            many = (await collect(engine, "hi", SamplingParams(max_tokens=5, n=3, seed=1, ignore_eos=True), "n"))[-1]
            assert [c.index for c in many.outputs] == [0, 1, 2] and many.finished
            # cancelling a consumer aborts its request in the core; the engine keeps serving
            long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate("x", long, "long"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(50):
                await asyncio.sleep(0.02)
                stats = await engine.get_stats()
                if stats["num_running_reqs"] == 0:
                    break
            assert stats["num_running_reqs"] == 0 and engine.num_in_flight() == 0
            with pytest.raises(ValueError, match="max_model_len=128"):
                await collect(engine, {"prompt_token_ids": [1] * 200}, GREEDY, "too-long")
        finally:
            await engine.shutdown_async()

    asyncio.run(main())


def test_killed_core_fails_waiters_and_restart_serves():
    async def main():
        engine = await AsyncLLMEngine.from_engine_args(args(multiprocess=True))
        try:
            first = (await collect(engine, "hello", GREEDY, "a"))[-1]
            long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate("hello", long, "b"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            os.kill(engine.client.pid, signal.SIGKILL)  # at its first output: 100+ tokens still to come
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(task, 30)
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            await engine.restart()
            await engine.check_health()
            again = (await collect(engine, "hello", GREEDY, "c"))[-1]
            assert again.outputs[0].token_ids == first.outputs[0].token_ids
        finally:
            await engine.shutdown_async()

    asyncio.run(main())


def test_prompt_logprobs_through_the_core_match_transformers():
    import torch

    from specdec.engine.tiny import tiny_random_llama_hf

    ids = [5, 6, 7, 8, 9]

    async def main():
        engine = await AsyncLLMEngine.from_engine_args(args())
        try:
            return (await collect(engine, {"prompt_token_ids": ids},
                                  SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), "p"))[-1]
        finally:
            await engine.shutdown_async()

    out = asyncio.run(main())
    with torch.no_grad():
        ref = torch.log_softmax(tiny_random_llama_hf(seed=0)(torch.tensor([ids])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, tok in enumerate(ids[1:]):
        assert abs(out.prompt_logprobs[i + 1][tok].logprob - float(ref[i, tok])) < 1e-4
        assert out.prompt_logprobs[i + 1][tok].rank == int((ref[i] > ref[i, tok]).sum()) + 1


def test_client_ids_are_only_echoed_never_used_inside():
    """The core sees the front end's own ids, so client ids cannot collide: "0_R" (once R's first child's id) sent
    while R runs with n=2, and a second "R", each get exactly their own greedy tokens, echo their own id, and
    nobody hangs (before #46 "0_R" got R's tokens and R's client waited forever)."""
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def main():
        engine = await AsyncLLMEngine.from_engine_args(args())
        try:
            started = asyncio.Event()

            async def parent():
                outs = []
                async for o in engine.generate("hello", SamplingParams(temperature=0.0, max_tokens=24,
                                                                       ignore_eos=True, n=2), "R"):
                    started.set()
                    outs.append(o)
                return outs[-1]

            task = asyncio.create_task(parent())
            await started.wait()
            others = [collect(engine, "abcabcabc", long, "0_R"), collect(engine, "why?", long, "R")]
            got = await asyncio.wait_for(asyncio.gather(task, *others), 60)
            return got[0], got[1][-1], got[2][-1], engine.num_in_flight()
        finally:
            await engine.shutdown_async()

    par, child_like, dup, left = asyncio.run(main())
    ref = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128).generate(
        ["hello", "abcabcabc", "why?"], long, use_tqdm=False)
    assert par.request_id == "R" and [len(c.token_ids) for c in par.outputs] == [24, 24]
    assert all(c.token_ids == ref[0].outputs[0].token_ids for c in par.outputs)  # greedy: both children alike
    assert child_like.request_id == "0_R" and child_like.outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert dup.request_id == "R" and dup.outputs[0].token_ids == ref[2].outputs[0].token_ids
    assert left == 0
