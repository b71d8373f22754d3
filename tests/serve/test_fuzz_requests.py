"""Fuzzing the OpenAI request schemas (hypothesis): whatever a client sends, the server answers a 4xx naming
what is wrong or serves it, never a 5xx.

Bodies are built from the schemas' own field names (completions and chat, the extension fields #49 accepts,
unknown ones) with values that are sometimes right and often of any JSON shape, plus raw bytes and mutated
bodies. The first two tests run each body through the server's whole preparation (decode, limits, prompt
checks, tokenizing, SamplingParams, the engine's own checks) in-process: only RequestError may come out. The
last sends a bounded number to a live server and runs the valid ones (a few tokens each).
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.serve.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestError

OTHERS = {"metadata", "tools", "response_format", "priority", "guided_json", "bogus", "stream_options"}
FIELDS = {"prompt": sorted(set(CompletionRequest.__struct_fields__) | OTHERS),
          "messages": sorted(set(ChatCompletionRequest.__struct_fields__) | OTHERS)}

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
SMALL_INT = st.integers(min_value=-2, max_value=600)
PLAUSIBLE = (SMALL_INT | st.floats(min_value=-3, max_value=3) | st.booleans() | st.text(max_size=8)
             | st.lists(SMALL_INT, max_size=6) | st.lists(st.text(min_size=1, max_size=6), max_size=4)
             | st.dictionaries(st.from_regex(r"-?[0-9]{1,4}", fullmatch=True) | st.text(max_size=3),
                               st.floats(min_value=-150, max_value=150), max_size=3)
             | st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                   "continuous_usage_stats": st.booleans()}))
VALUE = st.one_of(PLAUSIBLE, PLAUSIBLE, PLAUSIBLE, JUNK)
PROMPT = st.one_of(st.text(max_size=40), st.text(max_size=40), st.lists(st.integers(min_value=-1, max_value=600),
                                                                          max_size=8),
                   st.lists(st.text(max_size=10) | st.lists(SMALL_INT, max_size=5), max_size=4), JUNK)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.just("user"), st.sampled_from(["user", "system", "assistant", "tool", "", "x"]), JUNK)},
    optional={"content": st.one_of(st.text(max_size=30), st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10) | JUNK}), max_size=3), JUNK),
              "name": st.text(max_size=5) | JUNK})
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(MESSAGE, min_size=1, max_size=3), JUNK)


def bodies(main_field: str, main):
    """JSON bodies: the main field (usually present) and any others, plus raw bytes and cut-off bodies."""
    obj = st.one_of(*[st.fixed_dictionaries({main_field: main})] * 6, st.just({})).flatmap(
        lambda d: st.dictionaries(st.sampled_from(FIELDS[main_field]), VALUE, max_size=4).map(
            lambda extra: {**extra, **d}))
    # max_tokens small and stream off where given right, so the live test decodes a few tokens at most
    obj = obj.map(lambda d: {**d, "stream": False} if "stream" in d else d).map(
        lambda d: {**d, "max_tokens": 3} if isinstance(d.get("max_tokens"), int) and d["max_tokens"] > 3 else d)
    encoded = obj.map(lambda d: json.dumps(d).encode())
    cut = st.tuples(encoded, st.integers(min_value=0, max_value=200)).map(lambda t: t[0][:t[1]])
    flipped = st.tuples(encoded, st.integers(min_value=0), st.integers(min_value=0, max_value=255)).map(
        lambda t: t[0][:t[1] % max(len(t[0]), 1)] + bytes([t[2]]) + t[0][t[1] % max(len(t[0]), 1) + 1:])
    return st.one_of(*[encoded] * 6, cut, flipped, st.binary(max_size=64))


@pytest.fixture(scope="module")
def prepared_server():
    """An OpenAIServer over an engine that is never started: the tokenizer and checks, no core."""
    from specdec.entrypoints.engine_args import AsyncEngineArgs
    from specdec.serve.app import OpenAIServer
    from specdec.v1.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(AsyncEngineArgs(model="tiny-random-llama", max_model_len=256, max_num_seqs=4))
    return OpenAIServer(engine, "tiny-random-llama")


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=bodies("prompt", PROMPT))
@example(body=b'{"prompt": [-1]}')  # found by this test: the tokenizer's decode overflowed (a 500)
@example(body=b'{"prompt": [[5, 4294967296]]}')
def test_completions_bodies_are_served_or_refused_by_name(prepared_server, body):
    try:
        prepared_server._prepare_completion(body)
    except RequestError as e:
        assert str(e)


@FUZZ
@given(body=bodies("messages", MESSAGES))
def test_chat_bodies_are_served_or_refused_by_name(prepared_server, body):
    try:
        prepared_server._prepare_chat(body)
    except RequestError as e:
        assert str(e)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(chat=st.booleans(), data=st.data())
def test_a_live_server_never_answers_5xx(plain_server, chat, data):
    body = data.draw(bodies("messages", MESSAGES) if chat else bodies("prompt", PROMPT))
    r = httpx.post(f"{plain_server.url}/v1/{'chat/completions' if chat else 'completions'}", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
    if r.status_code == 200:
        assert all(c["finish_reason"] != "error" for c in r.json()["choices"]), r.text[:500]
    else:
        assert r.status_code == 400 and r.json()["error"]["message"], r.text[:500]
