"""Structured outputs stay lossless under speculation (specdec/sampling/guided.py), on the tiny model and its
byte-level tokenizer.

1. Greedy: the speculative output equals plain guided decoding, token for token, with finish reasons, for a JSON
   schema, a regex, a choice and an EBNF grammar beside an unguided request, through chains (n-gram, a partly
   right draft model) and trees (EAGLE-2's, a draft model's top-k tree).
2. Sampling: every generated token follows the *masked* target law: the randomised PIT of each token under
   softmax(target logits at its prefix, masked by a fresh matcher walked along that prefix, / T) is uniform
   (chi-square, p > 1e-3), for a chain and a tree; every token is allowed by a fresh matcher along the output.
   Power: the same tokens under a wrong temperature, p < 1e-6.
3. A request whose grammar leaves no token (complete with ignore_eos=True; or min_tokens masking the EOS the
   grammar requires) finishes with finish_reason='error' and a message that says why; its neighbours produce
   what they produce alone; every slot is freed.
4. Transactions: a step that raises (the verifier, with a poison request in the batch) is rolled back with the
   grammar matchers; the guided requests beside the poison give the clean run's tokens.
5. slow, SmolLM2-135M-Instruct: greedy JSON-schema output parses and validates, identical plain and n-gram.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.datamodel.sampling_params import GuidedDecodingParams as G
from specdec.engine.testing import rand_tokens
from specdec.engine.tiny import tiny_tokenizer
from specdec.sampling.guided import GrammarCompiler
from tests.spec_decode.helpers import (DELTA, LOSSLESS_SPECS, assert_greedy_equal, ids, pit_from_probs, target_forward,
                                       uniformity_pvalue)

SCHEMA = {"type": "object", "required": ["name", "n", "ok", "tags"],
          "properties": {"name": {"type": "string", "enum": ["ada", "bob", "cy"]}, "n": {"type": "integer"},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "pattern": "^[a-c]{2}$"}}}}
GUIDES = {
    "json": G(json=SCHEMA, disable_any_whitespace=True),
    "regex": G(regex=r"[a-c]{2,4}-\d{2}( \((home|work)\))?"),
    "choice": G(choice=["yes", "no", "maybe so"]),
    "grammar": G(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" [a-z]'),
}
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], rand_tokens(12, seed=1), [40, 41, 42, 43] * 4, rand_tokens(25, seed=2)]
SPECS = {
    **LOSSLESS_SPECS,
    "draft_tree": lambda: {"method": "proposers.tree_draft:TreeDraftProposer", "model": "tiny-random-llama",
                           "scorer": "tree", "num_speculative_tokens": 3, "tree_topk": 2, "tree_budget": 6},
}


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("guide", list(GUIDES))
def test_greedy_equal_to_plain_guided_decoding(spec, guide, plain_tiny):
    guided = SamplingParams(temperature=0.0, max_tokens=48, guided_decoding=GUIDES[guide])
    params = [guided, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), guided, guided]
    want = plain_tiny.generate(ids(PROMPTS), params, use_tqdm=False)
    assert [o.error for o in want] == [None] * 4
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS[spec]())
    got = llm.generate(ids(PROMPTS), params, use_tqdm=False)
    assert_greedy_equal(plain_tiny.engine, PROMPTS, got, want, f"{spec} / {guide}")
    assert llm.get_metrics().num_draft_tokens > 0, "nothing was drafted: the test would not exercise speculation"
    assert llm.engine.num_free_slots() == llm.engine.num_slots
    if guide == "choice":
        assert set(texts(want)[:1] + texts(want)[2:]) <= {"yes", "no", "maybe so"}
    if guide == "json":
        for o in (want[0], want[2], want[3]):
            if o.outputs[0].finish_reason == "stop":
                assert set(json.loads(o.outputs[0].text)) == {"name", "n", "ok", "tags"}


# ------------------------------------------------------------------ 2. the sampled law
# no letter or digit, exactly 60 characters: EOS never comes within 48 tokens, and the mask removes a large share of
# the target's mass (letters, digits, and every special id 259..511)
PIT_GUIDE = G(regex=r"[^a-zA-Z0-9]{60}")
PIT_PROMPTS = [rand_tokens(3 + 5 * (i % 7), seed=300 + i) for i in range(32)]
PIT_SPECS = {  # a copy of the target drafts (its unmasked law): many drafts are allowed and accepted
    "draft_model_k3": lambda: {"method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 3},
    "draft_tree": lambda: {"method": "proposers.tree_draft:TreeDraftProposer", "model": "tiny-random-llama",
                           "scorer": "tree", "num_speculative_tokens": 3, "tree_topk": 2, "tree_budget": 6},
}


def masked_pit(engine, compiler, prompts, outputs, sp: SamplingParams, gen: torch.Generator):
    """Randomised PIT of every generated token under softmax(target logits at its prefix, masked by a fresh
    matcher walked along the output so far, / T)."""
    import xgrammar as xgr

    from specdec.sampling.guided import unpack_bitmask
    from specdec.sampling.logits_process import MASKED

    us = []
    for prompt, out in zip(prompts, outputs):
        full = prompt + out
        logits = target_forward(engine, full[:-1]).logits[len(prompt) - 1:].clone()  # [len(out), V]
        m = xgr.GrammarMatcher(compiler.compile(sp.guided_decoding))
        bm = xgr.allocate_token_bitmask(len(out), logits.shape[-1])
        for i, t in enumerate(out):
            m.fill_next_token_bitmask(bm, i)
            assert m.accept_token(t), f"output token {i} ({t}) breaks the grammar"
        logits = logits.masked_fill(~unpack_bitmask(bm, logits.shape[-1]), MASKED)
        p = torch.softmax(logits.double() / sp.temperature, -1)
        us.append(pit_from_probs(p, torch.tensor(out), gen))
    return torch.cat(us)


@pytest.mark.parametrize("spec", list(PIT_SPECS))
def test_every_token_follows_the_masked_target(spec, plain_tiny):
    sp = SamplingParams(temperature=0.8, max_tokens=48, guided_decoding=PIT_GUIDE)
    llm = LLM("tiny-random-llama", max_num_seqs=32, max_model_len=128, speculative_config=PIT_SPECS[spec]())
    torch.manual_seed(0)
    outs = llm.generate(ids(PIT_PROMPTS), sp, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 48 for o in outs)
    toks = [o.outputs[0].token_ids for o in outs]
    m = llm.get_metrics()
    assert m.num_accepted_tokens > 100, f"only {m.num_accepted_tokens} drafts accepted: too few to test verification"
    compiler = GrammarCompiler(tiny_tokenizer(), 512, [2])
    u = masked_pit(plain_tiny.engine, compiler, PIT_PROMPTS, toks, sp, torch.Generator().manual_seed(0))
    pval = uniformity_pvalue(u)
    assert pval > DELTA, f"{spec}: PIT p-value {pval:.2e} over {u.numel()} tokens (tau {m.mean_acceptance_length:.2f})"
    # power: the same tokens under a wrong law (T = 1.1 instead of 0.8) are rejected. (The unmasked law is no
    # test of power: the randomised PIT orders tokens by probability, and the mask's holes fall in every bin.)
    hot = SamplingParams(temperature=1.1, max_tokens=48, guided_decoding=PIT_GUIDE)
    wrong = masked_pit(plain_tiny.engine, compiler, PIT_PROMPTS, toks, hot, torch.Generator().manual_seed(0))
    assert uniformity_pvalue(wrong) < 1e-6, "the check has no power: a wrong temperature passes"


# ------------------------------------------------------------------ 3. a grammar that dies
DYING = {  # the grammar "ab" is complete after two tokens; then only EOS is allowed
    "ignore_eos": (SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, guided_decoding=G(regex="ab")),
                   "grammar is complete"),
    "min_tokens": (SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, guided_decoding=G(regex="ab")),
                   "other processors"),
}
NEIGHBOURS = [SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=GUIDES["json"]),
              SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)]


@pytest.mark.parametrize("spec", [None, "ngram_k4", "draft_tree"])
@pytest.mark.parametrize("case", list(DYING))
def test_a_dying_grammar_ends_its_request_alone(case, spec):
    make = (lambda: LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
                        speculative_config=None if spec is None else SPECS[spec]()))
    dying, says = DYING[case]
    alone = make().generate(ids(PROMPTS[1:3]), NEIGHBOURS, use_tqdm=False)
    llm = make()
    outs = llm.generate(ids(PROMPTS[:3]), [dying] + NEIGHBOURS, use_tqdm=False)
    o = outs[0]
    assert o.outputs[0].finish_reason == "error" and o.error is not None
    assert "guided decoding (regex) allows no next token" in o.error and says in o.error, o.error
    assert bytes(o.outputs[0].text, "utf-8").startswith(b"ab") or not o.outputs[0].text.strip("ab")
    assert [x.outputs[0].token_ids for x in outs[1:]] == [x.outputs[0].token_ids for x in alone]
    assert llm.engine.num_free_slots() == llm.engine.num_slots


def test_a_bad_grammar_is_refused_at_the_door():
    llm = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"GuidedDecodingParams\.regex="):
        llm.generate(["hi"], {"guided_decoding": {"regex": "[a-"}}, use_tqdm=False)
    assert not llm.llm_engine.groups and not llm.llm_engine.has_unfinished_requests()


# ------------------------------------------------------------------ 4. transactions
POISON = [500, 501, 502, 7, 8]


@pytest.mark.parametrize("spec", [None, "ngram_k4", "draft_tree"])
def test_a_failed_step_rolls_the_grammar_back(spec, monkeypatch):
    params = [SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=GUIDES["json"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, guided_decoding=GUIDES["grammar"])]
    poison_params = SamplingParams(temperature=0.0, max_tokens=8, guided_decoding=GUIDES["regex"])

    def make():
        return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256,
                   speculative_config=None if spec is None else SPECS[spec]())

    clean = make().generate(ids(PROMPTS[:2]), params, use_tqdm=False)
    llm = make()
    worker = llm.llm_engine.worker
    poisoned = {"calls": 0}

    def check(ps):
        if any(p is poison_params for p in ps):
            poisoned["calls"] += 1
            raise RuntimeError("verifier: poison in the batch")

    if spec is None:
        real = worker.sampler

        def sampler(logits, ps, gens=None, **kw):
            check(ps)
            return real(logits, ps, gens, **kw)

        monkeypatch.setattr(worker, "sampler", sampler)
    else:
        real = worker.verifier.verify_proposals

        def verify(logits, proposals, roots, ps, *args, **kw):
            check(ps)
            return real(logits, proposals, roots, ps, *args, **kw)

        monkeypatch.setattr(worker.verifier, "verify_proposals", verify)
    outs = llm.generate(ids([PROMPTS[0], POISON, PROMPTS[1]]), [params[0], poison_params, params[1]], use_tqdm=False)
    assert poisoned["calls"] > 0 and outs[1].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in clean]
    assert llm.engine.num_free_slots() == llm.engine.num_slots


# ------------------------------------------------------------------ 5. the real model
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                       "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "city", "languages"], "additionalProperties": False}


@pytest.mark.slow
def test_smollm2_json_schema_output_parses_validates_and_speculation_changes_nothing():
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [[{"role": "user", "content": "Describe a fictional person as JSON with name, age, city and languages."}],
            [{"role": "user", "content": "Give a JSON record of a software engineer who lives in Tokyo."}]]
    sp = SamplingParams(temperature=0.0, max_tokens=128, guided_decoding=G(json=PERSON, disable_any_whitespace=True))
    outs = {}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM("smollm2-135m-instruct", max_num_seqs=2, max_model_len=512, speculative_config=spec)
        outs[name] = [o.outputs[0] for o in llm.chat(msgs, sp, use_tqdm=False)]
    for o in outs["plain"]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert [o.token_ids for o in outs["ngram"]] == [o.token_ids for o in outs["plain"]]
