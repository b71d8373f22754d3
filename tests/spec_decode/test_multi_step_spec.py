"""SpecDecodeWorker.decode_steps (multi-step speculative decoding's fast loop) on the tiny model: n-gram,
suffix and a (noisy) draft model at N = 1, 4, 8 give the same tokens, finish reasons and per-request
acceptance counts, for batch 1 and a ragged batch whose rows end mid-block (EOS, a stop id, max_tokens, a
stop string); an abort and a failing request mid-block leave the others as a clean run and leak no slot; the fast loop runs (``decode_blocks``) and
declines where it does not apply (a sampled row, logprobs).

Expected outputs are never hand-written: they come from the N = 1 run of the same engine."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.datamodel.sampling_params import SamplingParams
from tests.core.test_multi_step import PROMPTS, poison_one_mid_block
from tests.spec_decode.helpers import noisy_tiny_engine

SPECS = {"ngram": lambda: {"method": "ngram", "num_speculative_tokens": 3},
         "suffix": lambda: {"method": "suffix", "num_speculative_tokens": 3},
         # a draft model that disagrees with the target now and then: rejections mid-chain, its own KV rolled back
         "draft": lambda: {"method": "draft_model", "num_speculative_tokens": 3,
                           "options": {"engine": noisy_tiny_engine(0.15, num_slots=8)}}}
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make(spec: str, n: int, eos: int | None = None) -> LLM:
    llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=96, speculative_config=SPECS[spec](),
              num_scheduler_steps=n)
    llm.llm_engine.eos_token_id = eos
    return llm


def outputs(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             o.error, tuple(o.metrics.spec_token_acceptance_counts or ())) for o in outs]


@pytest.fixture(scope="module")
def clean() -> dict[str, list]:
    llm = make("ngram", 1)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    return {"toks": [o.outputs[0].token_ids for o in outs], "text": [o.outputs[0].text for o in outs]}


def ragged(clean) -> list[SamplingParams]:
    toks, text = clean["toks"], clean["text"]
    stop = next(text[2][i:i + 2] for i in range(3, 12) if text[2][i:i + 2] not in text[2][:i + 1])
    return [SamplingParams(max_tokens=21, **GREEDY),
            SamplingParams(max_tokens=5, **GREEDY),  # ends inside the first block
            SamplingParams(max_tokens=24, stop=[stop], **GREEDY),  # a stop string: the replay cuts
            SamplingParams(max_tokens=24, stop_token_ids=[toks[3][6]], **GREEDY),
            SamplingParams(max_tokens=19, **GREEDY)]


@pytest.mark.parametrize("batch", ["one", "ragged"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_every_n_gives_the_tokens_and_acceptance_of_n1(spec, batch, clean, one_thread):
    prompts, params = (PROMPTS[:1], SamplingParams(max_tokens=40, **GREEDY)) if batch == "one" \
        else (PROMPTS, ragged(clean))
    ref = None
    for n in (1, 4, 8):
        llm = make(spec, n)
        got = outputs(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.num_free_slots() == llm.engine.num_slots
        assert (llm.worker.decode_blocks > 0) == (n > 1)  # the fast loop ran every multi-step block
        ref = ref or got
        assert got == ref, f"{spec} {batch} N={n}"
    assert any(sum(r[5][1:]) for r in ref)  # drafts were accepted: the comparison covers acceptance
    if batch == "ragged":
        assert len(ref[1][0]) == 5 and ref[2][2] == "stop" and ref[3][2] == "stop"


@pytest.mark.parametrize("spec", list(SPECS))
def test_eos_mid_block(spec, clean, one_thread):
    eos = clean["toks"][0][10]
    ref = None
    for n in (1, 8):
        llm = make(spec, n, eos=eos)
        got = outputs(llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False))
        ref = ref or got
        assert got == ref and got[0][0][-1] == eos


def test_falls_back_where_it_does_not_apply(clean, one_thread):
    """A sampled row or a row asking logprobs: execute_model per step, the same outputs as N = 1."""
    for params in (SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=12, logprobs=2, **GREEDY)):
        ref = outputs(make("ngram", 1).generate(PROMPTS[:2], params, use_tqdm=False))
        llm = make("ngram", 8)
        assert outputs(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == ref
        assert llm.worker.decode_blocks == 0


@pytest.mark.parametrize("spec", list(SPECS))
def test_abort_mid_way_leaves_the_others_as_a_clean_run(spec, clean, one_thread):
    llm = make(spec, 8)
    params = SamplingParams(max_tokens=24, **GREEDY)
    long = SamplingParams(max_tokens=80, **GREEDY)  # one block cannot finish it (suffix may emit 4 per step)
    ids = [llm.add_request(p, long if i == 1 else params) for i, p in enumerate(PROMPTS[:3])]
    outs = {o.request_id: o for o in llm.step() + llm.step()}  # the prefill, one block
    llm.abort(ids[1])
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    outs.update({o.request_id: o for o in llm.step()})
    assert outs[ids[1]].outputs[0].finish_reason == "abort"
    assert [outs[i].outputs[0].token_ids for i in (ids[0], ids[2])] == [clean["toks"][0], clean["toks"][2]]
    assert llm.engine.num_free_slots() == llm.engine.num_slots and llm.worker.decode_blocks > 0


@pytest.mark.parametrize("spec", list(SPECS))
def test_a_request_failing_mid_block_stops_alone(spec, clean, one_thread, monkeypatch):
    llm = make(spec, 8)
    poison_one_mid_block(llm, llm.worker.plain.slots, clean["toks"], monkeypatch, after=6)


def test_top1_chain_lists_equal_the_tensor_path():
    """Top1Proposer._chain's list path (deterministic drafts) builds the tensors its tensor path builds
    (forced here by handing the same drafts with one-hot-free zero probs)."""
    import torch

    from specdec.spec_decode.proposer import DraftOutput
    from specdec.spec_decode.top1_proposer import Top1Proposer

    top1 = Top1Proposer(None, k=4, max_model_len=100, vocab_size=8)
    got = torch.tensor([[5, 6, 7], [1, -1, 9], [2, 3, 4]])  # n = 3 < k; row 1 says 1 draft, junk after it
    for lens in (torch.tensor([3, 1, 0]), torch.tensor([2, 1, 3]), None):
        if lens is None:
            got[1, 1] = 8  # every row full: no junk
        fast = top1._chain(DraftOutput(got, None, lens), [0, 2, 3], 5, "x")
        slow = top1._chain(DraftOutput(got, torch.zeros(3, 3, 8), lens), [0, 2, 3], 5, "x")
        assert torch.equal(fast.token_ids, slow.token_ids) and torch.equal(fast.num_nodes, slow.num_nodes)
        assert torch.equal(fast.parents, slow.parents) and fast.draft_probs is None
