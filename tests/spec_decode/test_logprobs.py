"""Logprobs under speculation: the top-n ``logprobs`` and the ``logprob_token_ids`` of every emitted token
come from the raw target logits at that token's position (the accepted path's rows, ``verdict.path``), so
greedy speculative runs (n-gram chain, EAGLE tree) report the plain run's dicts, and both equal
log_softmax of a fresh target forward over prompt + output."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from specdec.interfaces import Verdict
from specdec.sampling.logprobs import emitted_logprobs, position_logprobs
from tests.spec_decode.helpers import target_forward

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43] * 4, [9, 100, 250, 3, 77]]
IDS = [5, 43, 300, 511]  # ids asked for at every position: some emitted, some never (300, 511)
SPECS = {
    "plain": lambda: None,
    "ngram": lambda: {"method": "ngram", "num_speculative_tokens": 4},
    "eagle_tree": lambda: {"method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3,
                           "scorer": "tree", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6},
}
PARAMS = {  # top-n and ids together, ids alone (no top-n: the dicts hold the token and the ids)
    "top3_ids": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3, logprob_token_ids=IDS),
    "ids_only": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprob_token_ids=IDS),
}


def run(spec: str, sp: SamplingParams):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS[spec]())
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    return llm, outs


@pytest.fixture(scope="module", params=list(PARAMS))
def plain(request):
    return request.param, run("plain", PARAMS[request.param])


def assert_same_dicts(a: list[dict], b: list[dict], label: str) -> None:
    assert len(a) == len(b), label
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), f"{label}: position {i} has ids {sorted(x)} vs {sorted(y)}"
        for t in x:
            assert x[t].rank == y[t].rank, f"{label}: position {i}, token {t}: rank {x[t].rank} vs {y[t].rank}"
            assert abs(x[t].logprob - y[t].logprob) <= 1e-4, f"{label}: position {i}, token {t}"


@pytest.mark.parametrize("spec", ["ngram", "eagle_tree"])
def test_speculative_dicts_equal_plain_dicts(spec, plain):
    name, (_, want) = plain
    llm, got = run(spec, PARAMS[name])
    assert llm.get_metrics().num_draft_tokens > 0  # speculation really ran
    for p, g, w in zip(PROMPTS, got, want):
        assert g.token_ids == w.token_ids
        assert_same_dicts(g.logprobs, w.logprobs, f"{spec}/{name} prompt {p[:3]}")
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("spec", list(SPECS))
def test_dicts_are_log_softmax_of_a_fresh_forward(spec, plain):
    name, _ = plain
    sp = PARAMS[name]
    llm, outs = run(spec, sp)
    for p, out in zip(PROMPTS, outs):
        full = p + out.token_ids
        lp = torch.log_softmax(target_forward(llm.engine, full[:-1]).logits[len(p) - 1:].double(), -1)  # [n, V]
        assert len(out.logprobs) == len(out.token_ids) == lp.shape[0]
        for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
            top = lp[i].topk(sp.logprobs or 0).indices.tolist()
            assert set(d) == {tok, *IDS, *top}
            assert [t for t, x in d.items() if x.rank is not None] == top and all(d[t].rank == r + 1 for r, t in
                                                                                 enumerate(top))
            for t, x in d.items():
                assert abs(x.logprob - float(lp[i, t])) <= 1e-4, f"{spec}: position {i}, token {t}"


def test_position_logprobs_on_hand_written_rows():
    rows = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])  # [E=2, V=4]
    lp = torch.log_softmax(rows, -1)
    none, ask = SamplingParams(), SamplingParams(logprobs=1, logprob_token_ids=[0, 3])
    d0, d1 = position_logprobs(rows, [2, 1], [ask, none])
    assert list(d0) == [3, 0, 2] and d0[3].rank == 1 and d0[0].rank is None and d0[2].rank is None
    assert d0[0].logprob == pytest.approx(float(lp[0, 0])) and d0[2].logprob == pytest.approx(float(lp[0, 2]))
    assert list(d1) == [1] and d1[1].logprob == pytest.approx(float(lp[1, 1]))  # asks nothing: the token only


def test_emitted_logprobs_read_the_accepted_path_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 16, generator=g)  # [B, M, V] root-inclusive
    verdict = Verdict(path=torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1]]),
                      out=torch.tensor([[4, 1, 6, -1], [3, -1, -1, -1]]))
    sp = SamplingParams(logprobs=2, logprob_token_ids=[7])
    got = emitted_logprobs(logits, verdict, [sp, SamplingParams()])
    assert [len(r) for r in got] == [3, 1]
    for d, node, tok in zip(got[0], [0, 2, 3], [4, 1, 6]):
        want = position_logprobs(logits[0, node][None], [tok], [sp])[0]
        assert d == want and 7 in d and tok in d
    assert list(got[1][0]) == [3]


def test_out_of_vocabulary_ids_are_refused_naming_the_field():
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=64)
    with pytest.raises(ValueError, match=r"logprob_token_ids has token ids \[512\] out of range"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(logprob_token_ids=[3, 512]), use_tqdm=False)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[-1])


def test_front_end_returns_the_same_dicts(plain):
    """Through AsyncLLMEngine (the v1 front end and its engine core), n-gram speculation on."""
    import asyncio

    name, (_, want) = plain

    async def main():
        engine = await AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
            model="tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS["ngram"]()))
        try:
            return [[o async for o in engine.generate({"prompt_token_ids": p}, PARAMS[name], f"r{i}")][-1]
                    for i, p in enumerate(PROMPTS)]
        finally:
            await engine.shutdown_async()

    for out, w in zip(asyncio.run(main()), want):
        assert out.outputs[0].token_ids == w.token_ids
        assert_same_dicts(out.outputs[0].logprobs, w.logprobs, f"front end/{name}")
