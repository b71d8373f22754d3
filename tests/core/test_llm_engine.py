"""specdec/core/llm_engine.py on the tiny model with the plain worker: the request lifecycle (add_request,
step, has_unfinished_requests, pop_finished), stop conditions, aborts that free their KV slot at once,
duplicate ids refused, and a step that raises: the request that caused it finishes with
finish_reason='error' and the others get exactly the tokens of a clean run.

Expected tokens are never hand-written: they come from a clean run of the same engine, so the stop tests
pick their stop token out of the greedy continuation it produced."""

from __future__ import annotations

import pytest

from specdec.core.llm_engine import LLMEngine
from specdec.core.plain_worker import PlainWorker
from specdec.datamodel.sampling_params import SamplingParams
from specdec.engine import load_engine
from specdec.engine.testing import rand_tokens
from tests.reliability.test_fault_injection import (
    GOOD, GOOD_PARAMS, MIXED, MIXED_PARAMS, POISON, Boom, metas_poisoned,
)

PROMPT = rand_tokens(6, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make(max_num_seqs: int = 4, *, eos: int | None = None, max_model_len: int = 64,
         worker_cls=PlainWorker) -> LLMEngine:
    model = load_engine("tiny-random-llama", num_slots=max_num_seqs, max_model_len=max_model_len, seed=0)
    return LLMEngine(worker_cls(model), None, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     eos_token_id=eos, vocab_size=model.vocab_size)


def free_slots(engine: LLMEngine) -> int:
    return engine.worker.num_free_slots()


def run(engine: LLMEngine) -> dict:
    """Step until nothing is left; request id -> its RequestOutput."""
    outs = {}
    while engine.has_unfinished_requests():
        engine.step()
        outs.update({o.request_id: o for o in engine.pop_finished()})
    outs.update({o.request_id: o for o in engine.pop_finished()})
    return outs


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def clean():
    """The greedy continuation of PROMPT with no EOS (10 tokens), the reference of the stop tests."""
    engine = make()
    rid = engine.add_request(PROMPT, GREEDY)
    return tokens(run(engine)[rid])


def test_lifecycle_add_step_finish_pop(clean):
    engine = make(max_num_seqs=2)
    full = free_slots(engine)
    assert not engine.has_unfinished_requests()
    engine.step()  # nothing to do: a no-op
    a = engine.add_request(PROMPT, GREEDY)
    b = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=3))
    assert (a, b) == ("0", "1") and engine.has_unfinished_requests() and not engine.has_finished_outputs()
    engine.step()  # the prefill: one token each, both now hold a slot
    assert free_slots(engine) == full - 2 and engine.pop_finished() == []
    outs = run(engine)
    assert not engine.has_unfinished_requests() and free_slots(engine) == full
    assert tokens(outs[a]) == clean and outs[a].outputs[0].finish_reason == "length"
    assert tokens(outs[b]) == clean[:3] and outs[b].finished and outs[b].error is None
    assert engine.pop_finished() == [] and not engine.groups  # handed back once, then forgotten


def test_auto_ids_skip_one_the_caller_chose():
    engine = make()
    assert engine.add_request(PROMPT, GREEDY, request_id="0") == "0"
    assert engine.add_request(PROMPT, GREEDY) == "1"


def stop_at(clean: list[int]) -> tuple[int, int]:
    """A token of the clean continuation to stop on, and the index of its first occurrence there."""
    t = clean[3]
    return t, clean.index(t)


def test_eos_stops_and_ignore_eos_runs_on(clean):
    eos, j = stop_at(clean)
    engine = make(eos=eos)
    stops = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=10))
    ignores = engine.add_request(PROMPT, GREEDY)  # ignore_eos=True
    outs = run(engine)
    assert tokens(outs[stops]) == clean[: j + 1]  # the EOS is emitted, then nothing
    assert outs[stops].outputs[0].finish_reason == "stop" and outs[stops].outputs[0].stop_reason is None
    assert tokens(outs[ignores]) == clean and outs[ignores].outputs[0].finish_reason == "length"


def test_stop_token_ids_stop_and_name_the_token(clean):
    t, j = stop_at(clean)
    engine = make()
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[t]))
    out = run(engine)[rid]
    assert tokens(out) == clean[: j + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == t


def test_max_tokens_and_max_model_len_cap_the_output(clean):
    engine = make(max_model_len=len(PROMPT) + 4)
    capped = engine.add_request(PROMPT, GREEDY)  # max_tokens=10, but only 4 fit in max_model_len
    short = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outs = run(engine)
    assert tokens(outs[capped]) == clean[:4] and outs[capped].outputs[0].finish_reason == "length"
    assert tokens(outs[short]) == clean[:2] and outs[short].outputs[0].finish_reason == "length"


def test_abort_of_a_running_request_frees_its_slot_at_once(clean):
    engine = make()
    full = free_slots(engine)
    a = engine.add_request(PROMPT, GREEDY)
    b = engine.add_request(PROMPT, GREEDY)
    engine.step()
    engine.step()
    assert free_slots(engine) == full - 2
    engine.abort_request(a)
    assert free_slots(engine) == full - 1  # before any further step
    assert engine.has_finished_outputs()
    outs = run(engine)
    assert outs[a].outputs[0].finish_reason == "abort" and tokens(outs[a]) == clean[:2]
    assert tokens(outs[b]) == clean  # its neighbour's abort changes nothing
    assert free_slots(engine) == full
    engine.abort_request(a)  # aborting a request already handed back is a no-op
    engine.abort_request("never-added")
    assert engine.pop_finished() == []


def test_abort_of_a_waiting_request_never_runs_it(clean):
    engine = make(max_num_seqs=1)
    a = engine.add_request(PROMPT, GREEDY)
    b = engine.add_request(PROMPT, GREEDY)
    engine.step()  # a is prefilled; b waits for the only slot
    engine.abort_request(b)
    assert [o.request_id for o in engine.pop_finished()] == [b]
    outs = run(engine)
    assert b not in outs and tokens(outs[a]) == clean
    assert free_slots(engine) == 1 and not engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused_until_the_first_is_handed_back(clean):
    engine = make()
    engine.add_request(PROMPT, GREEDY, request_id="x")
    with pytest.raises(ValueError, match="request_id 'x' is already in use.*pass a unique request_id"):
        engine.add_request(PROMPT[:3], GREEDY, request_id="x")
    while engine.has_unfinished_requests():  # finished, but not yet handed back: still refused
        engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT[:3], GREEDY, request_id="x")
    [first] = engine.pop_finished()
    assert tokens(first) == clean and list(first.prompt_token_ids) == PROMPT  # the refused one admitted nothing
    engine.add_request(PROMPT, GREEDY, request_id="x")  # handed back: the id is free again
    assert tokens(run(engine)["x"]) == clean


def test_n_above_one_is_refused_here():
    engine = make()
    with pytest.raises(ValueError, match="SamplingParams.n=2"):
        engine.add_request(PROMPT, SamplingParams(n=2))
    assert not engine.has_unfinished_requests() and not engine.groups


class FaultyWorker(PlainWorker):
    """A plain worker whose step raises whenever the poison request is in its batch, in the phase
    ``fail_in`` names ("prefill" or "decode"). It raises after the step's work (KV written, slots
    allocated, seeded generators drawn), so only a full rollback gives the clean tokens."""

    fail_in = "prefill"

    def execute_model(self, execute_model_req):
        out = super().execute_model(execute_model_req)
        metas = execute_model_req.seq_group_metadata_list
        if metas_poisoned(metas) and metas[0].is_prompt == (self.fail_in == "prefill"):
            raise Boom("poison in the batch")
        return out


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_step_that_raises_stops_its_culprit_and_nobody_else(phase):
    clean_engine = make()
    clean_ids = [clean_engine.add_request(p, sp) for p, sp in zip(GOOD, GOOD_PARAMS)]
    clean_outs = run(clean_engine)
    want = [tokens(clean_outs[i]) for i in clean_ids]

    worker_cls = type("Faulty", (FaultyWorker,), {"fail_in": phase})
    engine = make(worker_cls=worker_cls)
    full = free_slots(engine)
    ids = [engine.add_request(p, sp) for p, sp in zip(MIXED, MIXED_PARAMS)]  # the poison is second
    outs = run(engine)
    bad = outs[ids[1]]
    assert list(bad.prompt_token_ids) == POISON
    assert bad.outputs[0].finish_reason == "error"
    assert "Boom: poison in the batch" in bad.error and "other requests continue unchanged" in bad.error
    # a prefill fault leaves it no token; a decode fault keeps its prefill token, the failed step's is undone
    assert len(tokens(bad)) == (0 if phase == "prefill" else 1)
    good = [outs[i] for i in ids[:1] + ids[2:]]
    assert [tokens(o) for o in good] == want  # the greedy and the seeded sampling requests alike
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in good)
    assert free_slots(engine) == full and not engine.groups


def test_the_idle_hook_runs_when_the_last_request_goes_by_abort():
    """on_idle (by default the worker's release: the engine hands back its decode threads) runs when nothing
    is left unfinished, whether the last request finished in a step or was aborted between steps."""
    engine = make(max_num_seqs=2)
    calls = []
    engine.on_idle = lambda: calls.append(engine.has_unfinished_requests())
    a = engine.add_request(PROMPT, GREEDY)
    b = engine.add_request(PROMPT, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(a)
    assert calls == []  # b still runs
    engine.abort_request(b)
    assert calls == [False]  # once, with nothing unfinished
    engine.step()  # nothing scheduled: no second call
    assert calls == [False]
