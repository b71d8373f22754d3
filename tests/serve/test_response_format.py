"""Structured outputs through the server (issue #47): OpenAI's ``response_format`` and vLLM's ``guided_*`` /
``structured_outputs`` fields, against a live server (HTTP, the engine core in its own process, which builds the
grammar compiler before it drops the tokenizer), with the official ``openai`` client.

The tiny random model's tokens are nonsense but still constrained: a grammar with one way to finish (choices, an
enum-only schema without whitespace, a bounded regex) gives outputs that parse. The JSON that a model writes on
its own (json_object, a schema with free strings and numbers) is checked on the real SmolLM2 (slow).
"""

import json
import threading

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from specdec.serve.compat import IGNORED_HEADER
from tests.serve.conftest import LiveServer, composed

MODEL = "tiny-random-llama"
MESSAGES = [{"role": "user", "content": "Pick a colour."}]
# one way to finish: {"colour":"red"} or {"colour":"blue"} (no whitespace: the backend option below)
ENUM_SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
               "additionalProperties": False}
COMPACT = {"guided_decoding_backend": "xgrammar:disable-any-whitespace"}  # vLLM 0.8's backend option


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, endpoint, body, status=200) -> httpx.Response:
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)
    assert r.status_code == status, (body, r.status_code, r.text)
    return r


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def chat(server, **kw) -> ChatCompletion:
    return client(server).chat.completions.create(model=MODEL, messages=MESSAGES, **({"temperature": 0, "max_tokens": 48}
                                                                                       | kw))


def test_json_schema_via_openai_client_parses_validates_and_is_lossless_under_speculation(plain_server,
                                                                                         ngram_server):
    """response_format json_schema (OpenAI's shape, strict): the content parses and validates, finishing on the
    grammar's end (EOS, "stop"); greedy output is the same with n-gram speculation on and off."""
    got = []
    for srv in (plain_server, ngram_server):
        r = chat(srv, response_format=schema_format(ENUM_SCHEMA), extra_body=COMPACT)
        content = r.choices[0].message.content
        jsonschema.validate(json.loads(content), ENUM_SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        got.append(content)
    assert got[0] == got[1]


def test_json_object_is_constrained_and_lossless_under_speculation(plain_server, ngram_server):
    """response_format json_object on the tiny model: an object is opened at once (its nonsense tokens are
    held to JSON: the first character is "{"), identical with speculation on and off."""
    outs = [chat(srv, response_format={"type": "json_object"}, max_tokens=24).choices[0].message.content
            for srv in (plain_server, ngram_server)]
    assert outs[0] == outs[1] and outs[0].lstrip().startswith("{")
    free = chat(plain_server, max_tokens=24).choices[0].message.content
    assert free != outs[0]  # the constraint changed the output


def test_guided_choice_and_regex_on_both_endpoints(plain_server, ngram_server):
    """vLLM's guided_choice returns one of the choices (chat and completions); guided_regex a full match;
    structured_outputs (vLLM's newer shape) the same as guided_choice; all lossless under speculation."""
    choices = ["positive", "negative", "neutral"]
    for srv in (plain_server, ngram_server):
        r = chat(srv, extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
        r2 = chat(srv, extra_body={"structured_outputs": {"choice": choices}})
        assert r2.choices[0].message.content == r.choices[0].message.content
        c = client(srv).completions.create(model=MODEL, prompt="The answer is", max_tokens=16, temperature=0,
                                           extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
        assert Completion.model_validate(c.model_dump())
        text = c.choices[0].text
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")
    same = {srv.url: (chat(srv, extra_body={"guided_choice": choices}).choices[0].message.content,
                      client(srv).completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=0,
                                                     extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"}).choices[0].text)
            for srv in (plain_server, ngram_server)}
    assert len(set(same.values())) == 1


def test_sampled_and_streamed_outputs_hold_to_the_grammar(plain_server):
    """Sampling (n=3, seeded) and streaming: every choice is one of the choices; the streamed deltas join to it."""
    choices = ["alpha", "beta", "gamma", "delta"]
    r = client(plain_server).chat.completions.create(model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=5,
                                                     max_tokens=16, extra_body={"guided_choice": choices})
    assert all(ch.message.content in choices for ch in r.choices)
    stream = client(plain_server).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16,
                                                          stream=True, extra_body={"guided_choice": choices})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat(plain_server, max_tokens=16, extra_body={"guided_choice": choices}).choices[0].message.content


def test_text_format_is_plain_and_no_field_is_ignored(plain_server):
    """response_format {"type": "text"} asks for nothing: the same output as without it; no structured-output
    field is named in the ignored-fields header (they are implemented)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    plain = post(plain_server, "chat/completions", body)
    text = post(plain_server, "chat/completions", body | {"response_format": {"type": "text"}})
    assert text.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    for extra in ({"response_format": {"type": "json_object"}}, {"guided_regex": "[a-z]+"},
                  {"guided_json": ENUM_SCHEMA, **COMPACT}, {"structured_outputs": {"json": ENUM_SCHEMA}}):
        r = post(plain_server, "chat/completions", body | extra)
        assert IGNORED_HEADER not in r.headers, extra


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("extra, field, words", [
    ({"response_format": schema_format({"type": "objekt"})}, "response_format", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"guided_json": '{"type": '}, "guided_json", "not JSON"),
    ({"guided_regex": "[0-9"}, "guided_regex", "Unclosed"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "not defined"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
    ({"guided_choice": [f"c{i}" for i in range(20000)]}, "guided_choice", "serve.limits.max_guided_bytes"),
    ({"response_format": schema_format({"enum": [f"e{i}" for i in range(20000)]})}, "response_format",
     "serve.limits.max_guided_bytes"),
])
def test_bad_structured_outputs_are_400_naming_the_field(plain_server, endpoint, extra, field, words):
    base = {"model": MODEL, "max_tokens": 4}
    base |= {"messages": MESSAGES} if endpoint == "chat/completions" else {"prompt": "hi"}
    r = post(plain_server, endpoint, base | extra, status=400)
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err


def test_bad_schema_via_openai_client_is_a_bad_request_naming_response_format(plain_server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(plain_server, response_format=schema_format({"type": "object", "properties": {"a": {"type": 5}}}))
    assert e.value.param == "response_format" and "response_format" in e.value.message
    assert chat(plain_server, max_tokens=4).choices[0].message.content is not None  # the server goes on


def test_a_bystander_is_unaffected(plain_server):
    """An unguided greedy request gives the same tokens alone and beside guided ones (batched with them)."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    alone = post(plain_server, "completions", body).json()["choices"][0]
    results: dict[int, dict] = {}
    guided = [{"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "temperature": 0.8, "seed": i,
               **[{"guided_choice": ["yes", "no"]}, {"response_format": {"type": "json_object"}},
                  {"guided_regex": "[a-z ]{5,30}"}][i]} for i in range(3)]

    def run(i: int) -> None:
        if i < 3:
            results[i] = post(plain_server, "chat/completions", guided[i]).json()
        else:
            results[i] = post(plain_server, "completions", body).json()["choices"][0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[3]["text"] == alone["text"]
    assert results[3]["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
    assert results[0]["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.slow
def test_smollm2_json_outputs_parse_validate_and_are_lossless_under_speculation():
    """The real model through the openai client: response_format json_schema (nested object, array, enum,
    integer) and json_object give content that parses (and validates) and ends on the grammar's end, the same
    with n-gram speculation on and off."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "city": {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
                 "required": ["name", "country"]},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "mood": {"enum": ["happy", "sad"]}},
        "required": ["name", "age", "city", "hobbies", "mood"]}
    messages = [{"role": "user", "content": "Describe a fictional person as JSON: name, age, city (name, country), "
                                            "hobbies and mood."}]
    model = "smollm2-135m-instruct"
    got = {}
    for name, overrides in (("plain", []), ("ngram", ["+experiment=ngram"])):
        srv = LiveServer(cfg=composed(*overrides, "max_model_len=1024", "max_num_seqs=4",
                                      "serve.restart_on_failure=false"))
        try:
            c = client(srv)
            r = c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=200,
                                          response_format=schema_format(schema))
            content = r.choices[0].message.content
            jsonschema.validate(json.loads(content), schema)
            assert r.choices[0].finish_reason == "stop"
            # json_object: a question whose object is short (this 135M model loops on open-ended objects)
            ask = [{"role": "user", "content": 'What is the capital of France? Answer as a JSON object with the key '
                                               '"capital".'}]
            r2 = c.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=200,
                                           response_format={"type": "json_object"})
            assert r2.choices[0].finish_reason == "stop"
            obj = json.loads(r2.choices[0].message.content)
            assert isinstance(obj, dict)
            got[name] = (content, r2.choices[0].message.content)
        finally:
            srv.stop()
    assert got["plain"] == got["ngram"]
    print("SmolLM2 json_schema:", got["plain"][0], "\njson_object:", got["plain"][1])
