"""Validation at the door (issue #16): one row per bad input a new user tried. Each must raise the exact
error type with a message naming the field (and the value), and admit nothing: the next call works."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.experiment.data import load_jsonl_prompts, load_spec_bench

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)


def nothing_admitted(llm: LLM) -> bool:
    return not llm.llm_engine.groups and not llm.has_unfinished_requests()


# (bad token id, error type, message) on the tiny model, vocab_size 512
BAD_TOKEN_IDS = [
    (1.7, TypeError, r"prompt_token_ids\[1\]=1.7 is a float: token ids must be ints in \[0, 512\)"),
    ("42", TypeError, r"prompt_token_ids\[1\]='42' is a str"),
    (True, TypeError, r"prompt_token_ids\[1\]=True is a bool"),
    (None, TypeError, r"prompt_token_ids\[1\]=None is a NoneType"),
    ("abc", TypeError, r"prompt_token_ids\[1\]='abc' is a str"),
    (2**70, ValueError, rf"prompt_token_ids\[1\]={2**70} is out of range: token ids must be ints in \[0, 512\)"),
    (-1, ValueError, r"prompt_token_ids\[1\]=-1 is out of range"),
    (512, ValueError, r"prompt_token_ids\[1\]=512 is out of range"),
]


@pytest.mark.parametrize("bad, exc, msg", BAD_TOKEN_IDS, ids=[repr(b) for b, _, _ in BAD_TOKEN_IDS])
def test_bad_token_ids_are_refused_before_anything_runs(llm, bad, exc, msg):
    with pytest.raises(exc, match=msg):
        llm.add_request({"prompt_token_ids": [5, bad, 6]}, GREEDY)
    with pytest.raises(exc, match=r"prompts\[1\]: " + msg):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, bad, 6]}], GREEDY, use_tqdm=False)
    assert nothing_admitted(llm)
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("prompt, exc, msg", [
    ({"prompt_token_ids": "123"}, TypeError, r"prompt_token_ids='123' must be a list of token ids"),
    ({"prompt_token_ids": 7}, TypeError, r"prompt_token_ids=7 must be a list of token ids"),
    (42, TypeError, r"prompt 42 is not a string"),
    ({"prompt": 5}, TypeError, r"is not a string, \{'prompt': str\}"),
])
def test_malformed_prompts_name_the_field(llm, prompt, exc, msg):
    with pytest.raises(exc, match=msg):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert nothing_admitted(llm)


BAD_PARAMS = [
    ({"max_tokens": 1.5}, TypeError, r"SamplingParams.max_tokens=1.5 is invalid: must be an int >= 1 \(got float\)"),
    ({"seed": 1.5}, TypeError, r"SamplingParams.seed=1.5 is invalid: must be None or an int in \[0, 2\*\*63\)"),
    ({"stop_token_ids": [-1]}, ValueError, r"SamplingParams.stop_token_ids=\[-1\] is invalid \(element \[0\]\)"),
    ({"max_tokens": True}, TypeError, r"SamplingParams.max_tokens=True is invalid"),
    ({"temperature": float("nan")}, ValueError, r"SamplingParams.temperature=nan is invalid: must be a finite"),
    ({"temperature": "0"}, TypeError, r"SamplingParams.temperature='0' is invalid"),
    ({"ignore_eos": 1}, TypeError, r"SamplingParams.ignore_eos=1 is invalid: must be True or False"),
    ({"seed": 2**64}, ValueError, r"SamplingParams.seed=18446744073709551616 is invalid"),
    ({"logprobs": -1}, ValueError, r"SamplingParams.logprobs=-1 is invalid"),
    ({"num_speculative_tokens": 2**64}, ValueError, r"SamplingParams.num_speculative_tokens=18446744073709551616 is "
                                                    r"invalid: must be None or an int in \[0, 2\*\*31\)"),
]


@pytest.mark.parametrize("kw, exc, msg", BAD_PARAMS, ids=[str(k) for k, _, _ in BAD_PARAMS])
def test_bad_sampling_params_name_field_value_and_range(llm, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        SamplingParams(**kw)
    with pytest.raises(exc, match=msg):  # the same through a dict, as generate and add_request take it
        llm.generate(["hi"], kw, use_tqdm=False)
    assert nothing_admitted(llm)


@pytest.mark.parametrize("t", [1e-6, 1e-38, 1e-45, 5e-324])
def test_a_temperature_too_small_to_divide_by_is_greedy(llm, t):
    """Logits divided by a temperature near float32's smallest overflow to inf, and such a row sampled near-least
    likely tokens; below GREEDY_BELOW = 1e-5 the request is greedy (vLLM's rule), seeded or not."""
    assert SamplingParams(temperature=t).temperature == 0.0 and SamplingParams(temperature=1e-5).temperature == 1e-5
    outs = llm.generate(["hello", "hello"], [GREEDY, SamplingParams(temperature=t, seed=3, max_tokens=4,
                                                                    ignore_eos=True)], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_a_stop_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids has \[512\], out of range: they must be ints in \[0, 512\)"):
        llm.generate(["hi", "there"], {"stop_token_ids": [512]}, use_tqdm=False)
    assert nothing_admitted(llm)


def test_an_unknown_sampling_key_lists_the_valid_ones(llm):
    with pytest.raises(ValueError, match=r"sampling_params has unknown keys \['max_token'\]; valid keys: n, "):
        llm.generate(["hi"], {"max_token": 3}, use_tqdm=False)
    with pytest.raises(TypeError, match="must be a SamplingParams, a dict of its fields or None"):
        llm.generate(["hi"], 3, use_tqdm=False)


def test_generate_takes_a_dict_like_add_request(llm):
    outs = llm.generate(["hello", "there"], {"max_tokens": 3, "temperature": 0, "ignore_eos": True}, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    rid = llm.add_request("hello", {"max_tokens": 2, "temperature": 0, "ignore_eos": True})
    got = []
    while llm.has_unfinished_requests():
        got += llm.step()
    assert [o.request_id for o in got] == [rid] and len(got[0].outputs[0].token_ids) == 2


def test_auto_request_ids_never_collide_with_user_ids():
    """The probe's repro: a user id "1" then generate([p, p, p]) raised and left request "0" orphaned."""
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)
    llm.add_request("hi", GREEDY, request_id="1")
    outs = llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "2", "3"]
    assert [o.request_id for o in llm.step()] == ["1"]  # finished meanwhile: handed back by the next step
    assert nothing_admitted(llm)


def test_a_duplicate_user_id_is_refused_and_admits_nothing(llm):
    llm.add_request("hi", GREEDY, request_id="mine")
    with pytest.raises(ValueError, match="request_id 'mine' is already in use"):
        llm.add_request("there", GREEDY, request_id="mine")
    with pytest.raises(TypeError, match="request_id=7 must be a str"):
        llm.add_request("there", GREEDY, request_id=7)
    assert list(llm.llm_engine.groups) == ["mine"]
    while llm.has_unfinished_requests():
        llm.step()
    assert nothing_admitted(llm)


@pytest.mark.parametrize("kwargs, exc, msg", [
    ({"speculative_config": "ngram"}, TypeError,
     r"speculative_config='ngram' must be a dict .*speculative_config=\{'method': 'ngram'"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 1000}}, ValueError,
     r"num_speculative_tokens=1000 is too large: at most 64"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 40}, "max_model_len": 64}, ValueError,
     r"num_speculative_tokens=40 is too large for max_model_len=64: .*max_model_len // 2 = 32"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2.5}}, ValueError,
     r"invalid speculative_config: Expected `int`, got `float` - at `\$.num_speculative_tokens`"),
    ({"speculative_config": {"method": "ngram", "num_speculative_token": 2}}, ValueError,
     r"invalid speculative_config: Object contains unknown field `num_speculative_token`"),
    ({"max_num_seqs": 0}, ValueError, r"LLM: max_num_seqs=0 must be an int >= 1"),
    ({"max_num_seqs": 1.5}, TypeError, r"LLM: max_num_seqs=1.5 must be an int >= 1"),
    ({"max_model_len": 1}, ValueError, r"LLM: max_model_len=1 must be an int >= 2"),
    ({"seed": 2**64}, ValueError, r"LLM: seed=18446744073709551616 is out of range"),  # was torch's overflow error
    ({"record_step_times": "no"}, TypeError, r"LLM: record_step_times='no' must be True or False"),  # was taken as True
    ({"max_num_seqs": 10**8}, ValueError, r"100000000 slots \(max_num_seqs\) x 128 tokens \(max_model_len\) need"),
])
def test_bad_engine_arguments_are_refused_before_loading(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        LLM("tiny-random-llama", **{"max_model_len": 128, **kwargs})


def test_model_none_and_engine_args_of_the_wrong_type_name_the_field():
    from specdec.entrypoints.engine_args import EngineArgs

    with pytest.raises(TypeError, match=r"LLM: model=None must be a model name or a path"):
        LLM(None)
    with pytest.raises(TypeError, match=r"EngineArgs: max_num_seqs='4' is invalid"):
        EngineArgs(model="tiny-random-llama", max_num_seqs="4")
    with pytest.raises(ValueError, match=r"EngineArgs: reserve_cores=-5 must be >= 0"):  # ran 7 threads on 2 cores
        EngineArgs(model="tiny-random-llama", reserve_cores=-5)


# ---------------------------------------------------------------------------------------------- datasets


def test_a_malformed_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=rf"{f}:3: not valid JSON"):
        load_jsonl_prompts(str(f))


def test_blank_lines_are_skipped(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('\n{"prompt": "a"}\n   \n{"prompt": "b"}\n\n')
    assert [p.turns for p in load_jsonl_prompts(str(f))] == [["a"], ["b"]]


@pytest.mark.parametrize("text, msg", [
    ("", r"is empty; it needs one JSON object per line"),
    ("\n  \n", r"is empty; it needs one JSON object per line"),
    ('[1, 2]\n', r":1: a JSON list, not an object"),
    ('{"prompt": 5}\n', r":1: 'prompt' must be a str, got int"),
])
def test_empty_or_malformed_jsonl_files_are_refused(tmp_path, text, msg):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(ValueError, match=msg):
        load_jsonl_prompts(str(f))


def test_a_spec_bench_file_with_a_bad_row_names_file_and_line(tmp_path):
    f = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "qa", "turns": ["x"]}, {"question_id": 2, "category": "qa"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=rf"{f}:2: no 'turns'"):
        load_spec_bench(path=str(f))
    with pytest.raises(ValueError, match="no prompts selected"):
        load_spec_bench(["math"], path=str(_write(tmp_path / "ok.jsonl", rows[:1])))


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("field, value, exc", [("max_tokens", 0, ValueError), ("top_p", 5.0, ValueError),
                                               ("temperature", float("nan"), ValueError), ("n", 0, ValueError),
                                               ("max_tokens", "8", TypeError)])
def test_a_field_set_after_construction_is_checked_at_the_door(llm, field, value, exc):
    """SamplingParams is mutable: a bad value set after construction used to run unchecked (max_tokens="8" failed
    the stop check of every request in its step, the good ones beside it included)."""
    sp = SamplingParams(max_tokens=8)
    setattr(sp, field, value)
    with pytest.raises(exc, match=rf"SamplingParams\.{field}="):
        llm.generate(["hi", "hello"], [GREEDY, sp], use_tqdm=False)
    assert nothing_admitted(llm)


@pytest.mark.parametrize("kw, msg", [({"bad_words_token_ids": [[]]}, r"bad_words_token_ids=\[\[\]\] is invalid"),
                                     ({"prompt_logprobs": 513}, r"prompt_logprobs=513 is invalid: at most the "
                                                                r"vocabulary's 512"),
                                     ({"logprobs": 10**9}, r"logprobs=1000000000 is invalid")])
def test_values_that_failed_inside_the_step_are_refused_at_the_door(llm, kw, msg):
    with pytest.raises(ValueError, match=msg):
        llm.generate(["hi"], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert nothing_admitted(llm)
