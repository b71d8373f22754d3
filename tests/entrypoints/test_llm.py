"""LLM API on the tiny model: order, prompts, bad input, seeds, continuous batching, slot hygiene, n > 1."""

import msgspec
import pytest
import torch

from specdec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def all_slots_free(llm: LLM) -> bool:
    return llm.engine.num_free_slots() == llm.engine.num_slots and not llm.worker.slots.slot_of


def test_outputs_in_input_order_and_prompt_forms(tiny_llm):
    prompts = ["hello there", {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt": "abc"}, "x" * 30, "why?"]
    outs = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs][1] == [5, 6, 7, 8]
    assert outs[0].prompt == "hello there" and outs[2].prompt == "abc"
    assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length" for o in outs)
    # the same prompt alone gives the same greedy tokens as inside a batch of 5 (ragged batching is exact)
    alone = tiny_llm.generate([prompts[3]], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert all_slots_free(tiny_llm)


def test_greedy_matches_transformers_generate():
    from specdec.engine.tiny import tiny_random_llama_hf

    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128, seed=0)
    hf = tiny_random_llama_hf(seed=0)
    for ids in ([1, 17, 42, 99, 3], [7] * 9 + [250]):
        ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=20,
                                                                         ignore_eos=True), use_tqdm=False)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert ours[0].outputs[0].token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("min_p", 2.0), ("max_tokens", 0), ("n", 0), ("logprobs", -1)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match="smollm2-135m-instruct.*tiny-random-llama"):
        LLM("no-such-model")


def test_empty_and_too_long_prompts_finish_with_length_and_others_run(tiny_llm):
    too_long = {"prompt_token_ids": list(range(1, 300))}  # max_model_len is 256
    outs = tiny_llm.generate([{"prompt_token_ids": []}, "fine prompt", too_long], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and "empty" in outs[0].error
    assert outs[2].outputs[0].finish_reason == "length" and "299 tokens" in outs[2].error
    assert "max_model_len=256" in outs[2].error
    assert outs[0].outputs[0].token_ids == [] and outs[2].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) == 12 and outs[1].error is None
    assert all_slots_free(tiny_llm)


def test_nan_logits_finish_one_request_with_error_others_continue(monkeypatch):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)
    real_forward = llm.engine.forward
    poisoned_slot = {}

    def forward(batch):
        out = real_forward(batch)
        # poison the logits of whichever sequence sits in the first slot handed out (request "bad")
        slot = poisoned_slot.setdefault("s", llm.worker.slots.slot_of.get(0))
        if slot in batch.slots:
            out.logits = out.logits.clone()
            out.logits[batch.slots.index(slot)] = float("nan")
        return out

    monkeypatch.setattr(llm.engine, "forward", forward)
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [9, 8]},
                         {"prompt_token_ids": [1, 2, 3, 4]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "NaN" in outs[0].error
    assert [o.outputs[0].finish_reason for o in outs[1:]] == ["length", "length"]
    clean = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)
    ref = clean.generate([{"prompt_token_ids": [9, 8]}], GREEDY, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert all_slots_free(llm)


def test_seed_makes_sampling_reproducible_whatever_the_batch(tiny_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate([{"prompt_token_ids": [4, 5, 6]}], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = tiny_llm.generate([{"prompt_token_ids": [9, 9]}, {"prompt_token_ids": [4, 5, 6]},
                               {"prompt_token_ids": [1]}], [others, sp, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert tiny_llm.generate([{"prompt_token_ids": [4, 5, 6]}], different,
                             use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_tokens_and_eos_end_requests(tiny_llm):
    first = tiny_llm.generate([{"prompt_token_ids": [4, 5, 6]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = first[3]
    out = tiny_llm.generate([{"prompt_token_ids": [4, 5, 6]}],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(stop) + 1]
    assert out.stop_reason == stop


def test_logprobs_returned_when_asked(tiny_llm):
    out = tiny_llm.generate([{"prompt_token_ids": [4, 5, 6]}],
                            SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].logprob <= 0.0 and len(lp) >= 3
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))


def test_continuous_batching_admits_fcfs_and_frees_at_once():
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=128)
    for i in range(5):
        llm.add_request({"prompt_token_ids": [i + 1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3 + i,
                                                                             ignore_eos=True), request_id=f"r{i}")
    finished_order = []
    while llm.has_unfinished_requests():
        assert len(llm.llm_engine.scheduler.running) <= 2
        finished_order += [o.request_id for o in llm.step()]
        assert llm.engine.num_free_slots() == 2 - len(llm.llm_engine.scheduler.running)
    assert finished_order == ["r0", "r1", "r2", "r3", "r4"]
    assert all_slots_free(llm)


def test_200_requests_with_aborts_leak_no_slot():
    llm = LLM("tiny-random-llama", max_num_seqs=8, max_model_len=64)
    gen = torch.Generator().manual_seed(0)
    ids, seen, reasons = [], set(), set()
    for i in range(200):
        n = int(torch.randint(0, 70, (1,), generator=gen))  # some empty, some too long
        sp = SamplingParams(temperature=float(i % 2), max_tokens=1 + i % 7, seed=i if i % 3 == 0 else None)
        ids.append(llm.add_request({"prompt_token_ids": [1 + (j % 200) for j in range(n)]}, sp,
                                   request_id=f"q{i}"))
        if i % 9 == 0:
            llm.abort(f"q{i}")  # abort while waiting
        if i % 4 == 0:
            for o in llm.step():
                seen.add(o.request_id)
                reasons.add(o.outputs[0].finish_reason)
            if i % 8 == 0 and llm.llm_engine.scheduler.running:
                llm.abort(llm.llm_engine.scheduler.running[0].request_id)  # abort while running
    while llm.has_unfinished_requests():
        outs = llm.step()
        seen.update(o.request_id for o in outs)
        reasons.update(o.outputs[0].finish_reason for o in outs)
    outs = llm.step()  # aborted last: handed back by the next step
    seen.update(o.request_id for o in outs)
    reasons.update(o.outputs[0].finish_reason for o in outs)
    assert seen == set(ids)
    assert all_slots_free(llm)
    assert {"abort", "length"} <= reasons


# ---------------------------------------------------------------------------- n > 1: one shared prefill
# The n children of a request are admitted in one prefill step; the first is fed, the others get its KV by
# ModelEngine.copy_prefix and sample their first token from its last-row logits (specdec/core/plain_worker.py).
N_SPECS = {
    "plain": lambda: None,
    "ngram": lambda: {"method": "ngram", "num_speculative_tokens": 3},
    "eagle_tree": lambda: {"method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3,
                           "scorer": "tree", "tree_depth": 3, "tree_topk": 2, "tree_budget": 6},
}
N_PROMPT = [5, 6, 7, 5, 6, 7, 5, 6] + [40, 41, 42, 43] * 5  # 28 tokens: longer than any scoring forward


def count_prefills(monkeypatch, llm: LLM) -> list[int]:
    """Record the longest query of every target forward that feeds a whole prompt (> k + 1 tokens)."""
    seen, forward = [], llm.engine.forward

    def counting(batch):
        if max(batch.query_lens) >= len(N_PROMPT):
            seen.append(max(batch.query_lens))
        return forward(batch)

    monkeypatch.setattr(llm.engine, "forward", counting)
    return seen


def worker_slots(llm: LLM):
    return getattr(llm.worker, "plain", llm.worker).slots


@pytest.mark.parametrize("spec", list(N_SPECS))
def test_n_greedy_children_equal_one_request_and_prefill_once(spec, monkeypatch):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, speculative_config=N_SPECS[spec]())
    one = llm.generate([{"prompt_token_ids": N_PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0]
    prefills = count_prefills(monkeypatch, llm)
    many = llm.generate([{"prompt_token_ids": N_PROMPT}], msgspec.structs.replace(GREEDY, n=4), use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == one.token_ids for c in many.outputs)
    assert prefills == [len(N_PROMPT)]  # one forward fed the prompt, for all four children
    assert llm.engine.num_free_slots() == llm.engine.num_slots and not worker_slots(llm).slot_of


@pytest.mark.parametrize("spec", ["plain", "ngram"])
def test_n_seeded_children_equal_separate_requests(spec, monkeypatch):
    """Child i keeps seed + i (specdec/core/parallel.py): the shared prefill gives exactly the tokens of
    submitting each child alone (each prefilling itself), the behaviour before prefills were shared."""
    from specdec.core.parallel import child_params

    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11, n=4)
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, speculative_config=N_SPECS[spec]())
    alone = [llm.generate([{"prompt_token_ids": N_PROMPT}], child_params(sp, i), use_tqdm=False)[0].outputs[0].token_ids
             for i in range(4)]
    prefills = count_prefills(monkeypatch, llm)
    many = llm.generate([{"prompt_token_ids": N_PROMPT}], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in many.outputs] == alone
    assert len({tuple(t) for t in alone}) > 1  # the children really differ
    assert prefills == [len(N_PROMPT)]


@pytest.mark.parametrize("spec", ["plain", "eagle_tree"])
def test_aborting_a_parent_mid_run_frees_every_child_slot(spec):
    from specdec.core.parallel import child_params, child_request_id

    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, speculative_config=N_SPECS[spec]())
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=4)
    eng = llm.llm_engine
    kids = [eng.add_request(N_PROMPT, child_params(sp, i), request_id=child_request_id("p", i)) for i in range(4)]
    for _ in range(3):  # the shared prefill, then two decode steps
        eng.step()
    assert llm.engine.num_free_slots() == llm.engine.num_slots - 4
    for rid in kids:  # what AsyncLLMEngine does when the parent's consumer goes away
        eng.abort_request(rid)
    outs = llm.step()
    assert sorted(o.request_id for o in outs) == sorted(kids) and {o.outputs[0].finish_reason for o in outs} == {"abort"}
    assert llm.engine.num_free_slots() == llm.engine.num_slots and not worker_slots(llm).slot_of
    again = llm.generate([{"prompt_token_ids": N_PROMPT}], msgspec.structs.replace(sp, max_tokens=6), use_tqdm=False)[0]
    assert len(again.outputs) == 4 and llm.engine.num_free_slots() == llm.engine.num_slots
