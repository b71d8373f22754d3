"""Fault injection: a failed step never corrupts its neighbours (issue #16).

The matrix {bad token id, an exception in the proposer / scorer / verifier / engine forward, a
KeyboardInterrupt in a prefill / a decode} x {plain, ngram, draft_model, layer_skip, eagle, tree} on the
tiny model. Four good requests (two greedy, two seeded sampling) run beside one *poison* request whose
presence in a batch makes the patched component raise. After each fault:

- every good request's tokens equal a clean run's (the same requests without the poison), token for token;
- the poison finishes with ``finish_reason='error'`` and a message naming the exception;
- no target or draft KV slot is leaked, and the next ``generate()`` gives the clean tokens again.

A KeyboardInterrupt is nobody's fault: it propagates after the step is rolled back, and stepping on gives
the clean tokens. Faults are injected by wrapping components of the test's own LLM (monkeypatch), never
by changing production code. Plain decoding has no proposer or scorer; its "verifier" is the sampler.
"""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens

MARK = [500, 501, 502, 503]  # the poison prompt starts with these ids; no good prompt does
GOOD = [[5, 6, 7, 8, 5, 6, 7], rand_tokens(12, seed=1), [40, 41, 42, 43] * 4, rand_tokens(9, seed=2)]
POISON = MARK + [7, 8, 9]
GOOD_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12, max_tokens=10, ignore_eos=True),
]
POISON_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# the poison goes second, so it shares the first prefill and the decode batches with three good requests
MIXED, MIXED_PARAMS = GOOD[:1] + [POISON] + GOOD[1:], GOOD_PARAMS[:1] + [POISON_PARAMS] + GOOD_PARAMS[1:]

METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 3},
    "layer_skip": {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "model": "tiny-random-llama", "num_speculative_tokens": 3},
    "tree": {"method": "proposers.tree_draft:TreeDraftProposer", "model": "tiny-random-llama", "scorer": "tree",
             "num_speculative_tokens": 3, "tree_topk": 2, "tree_budget": 6},
}
FAULTS = ["bad_token_id", "proposer", "scorer", "verifier", "forward", "interrupt_prefill", "interrupt_decode"]
NOT_APPLICABLE = {("plain", "proposer"), ("plain", "scorer")}  # plain decoding has neither


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    yield
    torch.set_num_threads(n)


def make_llm(method: str) -> LLM:
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128, speculative_config=METHODS[method])


_CLEAN: dict[str, list[list[int]]] = {}


def clean_tokens(method: str) -> list[list[int]]:
    """The good requests' tokens from a fresh LLM that never saw the poison."""
    if method not in _CLEAN:
        outs = make_llm(method).generate(prompts(GOOD), GOOD_PARAMS, use_tqdm=False)
        _CLEAN[method] = [o.outputs[0].token_ids for o in outs]
    return _CLEAN[method]


def prompts(token_lists) -> list[dict]:
    return [{"prompt_token_ids": list(p)} for p in token_lists]


def poisoned(token_ids) -> bool:
    return list(token_ids[: len(MARK)]) == MARK


def metas_poisoned(metas) -> bool:
    return any(poisoned(m.first_seq_data().get_prompt_token_ids()) for m in metas)


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.num_free_slots() == llm.engine.num_slots, "target KV slots leaked"
    proposer = getattr(getattr(llm.worker, "top1", None), "proposer", None)
    draft = getattr(proposer, "engine", None)
    if draft is not None:
        assert draft.num_free_slots() == draft.num_slots, "draft KV slots leaked"
    head = getattr(proposer, "head", None)
    if head is not None:
        assert head.cache.num_free() == head.cache.num_slots, "EAGLE head slots leaked"
    assert not llm.llm_engine.groups and not llm.has_unfinished_requests()


def slot_table(llm: LLM):
    return llm.worker.slots if hasattr(llm.worker, "slots") else llm.worker.plain.slots


class Boom(RuntimeError):
    pass


def inject(llm: LLM, fault: str, monkeypatch) -> None:
    """Wrap the component ``fault`` names so that it raises Boom whenever the poison is in its batch."""
    worker = llm.worker
    if fault == "proposer":
        prop = worker.top1.proposer
        name = "propose_tree" if worker.top1.shape is not None else "propose"
        real = getattr(prop, name)

        def propose(batch, *args):
            if any(poisoned(t) for t in batch.token_ids):
                raise Boom("proposer: poison in the batch")
            return real(batch, *args)

        monkeypatch.setattr(prop, name, propose)
    elif fault == "scorer":
        real_score = worker.scorer.score_proposals

        def score(req, proposals):
            if metas_poisoned(req.seq_group_metadata_list):
                raise Boom("scorer: poison in the batch")
            return real_score(req, proposals)

        monkeypatch.setattr(worker.scorer, "score_proposals", score)
    elif fault == "verifier":
        def check(params):
            if any(p is POISON_PARAMS for p in params):
                raise Boom("verifier: poison in the batch")

        if hasattr(worker, "verifier"):
            real_verify = worker.verifier.verify_proposals

            def verify(logits, proposals, roots, params, *args, **kw):
                check(params)
                return real_verify(logits, proposals, roots, params, *args, **kw)

            monkeypatch.setattr(worker.verifier, "verify_proposals", verify)
        else:  # plain decoding: the sampler is the verifier
            real_sampler = worker.sampler

            def sampler(logits, params, gens=None, **kw):
                check(params)
                return real_sampler(logits, params, gens, **kw)

            monkeypatch.setattr(worker, "sampler", sampler)
    elif fault == "forward":
        real_forward = llm.engine.forward  # an EAGLE tap may already wrap it: wrap that

        def forward(batch):
            poison = [g for g in llm.llm_engine.groups.values() if poisoned(g.prompt_token_ids)]
            slot = slot_table(llm).slot_of.get(poison[0].first_seq.seq_id) if poison else None
            if slot is not None and slot in batch.slots:
                raise Boom("engine forward: poison in the batch")
            return real_forward(batch)

        monkeypatch.setattr(llm.engine, "forward", forward)


def interrupt_at(llm: LLM, prefill: bool, nth: int, monkeypatch) -> dict:
    """Raise KeyboardInterrupt from the target's ``nth`` prefill (or decode) forward, once."""
    real_forward = llm.engine.forward
    seen = {"n": 0, "nth": nth, "fired": False}

    def forward(batch):
        is_prefill = all(llm.engine.seq_len(s) == 0 for s in batch.slots)
        if is_prefill == prefill and not seen["fired"]:
            seen["n"] += 1
            if seen["n"] == seen["nth"]:
                seen["fired"] = True
                raise KeyboardInterrupt
        return real_forward(batch)

    monkeypatch.setattr(llm.engine, "forward", forward)
    return seen


CASES = [(m, f) for m in METHODS for f in FAULTS if (m, f) not in NOT_APPLICABLE]


@pytest.mark.parametrize("method, fault", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_a_fault_never_corrupts_the_other_requests(method, fault, monkeypatch):
    want = clean_tokens(method)
    llm = make_llm(method)
    if fault == "bad_token_id":
        bad = {"prompt_token_ids": [5, llm.engine.vocab_size, 6]}  # caught at the door, before any forward
        with pytest.raises(ValueError, match=r"prompts\[4\]: prompt_token_ids\[1\]=512 is out of range"):
            llm.generate(prompts(GOOD) + [bad], GOOD_PARAMS + [POISON_PARAMS], use_tqdm=False)
        assert not llm.llm_engine.groups, "a rejected generate() left requests behind"
        outs = llm.generate(prompts(GOOD), GOOD_PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    elif fault.startswith("interrupt"):
        # nth=2: the prefill of the 5th request (admitted after a slot frees) / the 3rd decode step
        fired = interrupt_at(llm, fault == "interrupt_prefill", 2 if fault == "interrupt_prefill" else 3, monkeypatch)
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts(GOOD + [POISON]), GOOD_PARAMS + [POISON_PARAMS])]
        got = {}
        interrupted = False
        while llm.has_unfinished_requests():
            try:
                outs = llm.step()
            except KeyboardInterrupt:
                interrupted = True
                continue
            got.update({o.request_id: o.outputs[0].token_ids for o in outs})
        assert interrupted and fired["fired"]
        assert [got[i] for i in ids[:4]] == want
        assert llm.llm_engine.errors == {}
        # and an interrupted generate() leaves the engine ready for the next one
        fired.update(n=0, nth=1, fired=False)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts(GOOD), GOOD_PARAMS, use_tqdm=False)
        assert_no_leak(llm)
    else:
        inject(llm, fault, monkeypatch)
        outs = llm.generate(prompts(MIXED), MIXED_PARAMS, use_tqdm=False)
        bad, good = outs[1], outs[:1] + outs[2:]
        assert [o.outputs[0].token_ids for o in good] == want
        assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in good)
        assert bad.outputs[0].finish_reason == "error"
        assert "Boom" in bad.error and "poison in the batch" in bad.error and "other requests continue" in bad.error
        monkeypatch.undo()
    assert_no_leak(llm)
    again = llm.generate(prompts(GOOD), GOOD_PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert_no_leak(llm)


def test_a_transient_fault_costs_nothing(monkeypatch):
    """A fault that does not come back (probes all pass) leaves every request's tokens unchanged."""
    llm = make_llm("ngram")
    real = llm.engine.forward
    calls = {"n": 0}

    def forward(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise Boom("a one-off fault")
        return real(batch)

    monkeypatch.setattr(llm.engine, "forward", forward)
    outs = llm.generate(prompts(GOOD), GOOD_PARAMS, use_tqdm=False)
    assert calls["n"] > 4
    assert [o.outputs[0].token_ids for o in outs] == clean_tokens("ngram")
    assert all(o.error is None for o in outs)


def test_a_fault_nobody_causes_alone_stops_the_step_but_not_the_engine(monkeypatch):
    """Two requests that fail only together: neither is a culprit alone, so the step's requests stop
    with an error saying so; later requests run normally."""
    llm = make_llm("plain")
    real = llm.engine.forward

    def forward(batch):
        if len(batch.slots) >= 2 and all(llm.engine.seq_len(s) > 0 for s in batch.slots):
            raise Boom("fails with two or more decoding sequences")
        return real(batch)

    monkeypatch.setattr(llm.engine, "forward", forward)
    outs = llm.generate(prompts(GOOD[:2]), GOOD_PARAMS[:2], use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" and "could not be told apart" in o.error for o in outs)
    assert_no_leak(llm)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(GOOD), GOOD_PARAMS, use_tqdm=False)] == \
        clean_tokens("plain")
