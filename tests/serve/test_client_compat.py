"""Real OpenAI clients, unmodified (issue #49): the request shapes of common clients against a live server (HTTP,
the engine core in its own process), every answer a 200 in the OpenAI schema (the ``openai`` package's types).

- a load generator's stream with ``stream_options.continuous_usage_stats``: usage on every chunk, the last right;
- an evaluation harness's loglikelihood: token-id prompts, batched, ``echo`` + ``logprobs`` with ``max_tokens`` 1
  and 0; a 4-choice item's scores equal the server's own ``prompt_logprobs`` sums, bit for bit, and are
  bit-identical with n-gram speculation on and off;
- chat with ``top_logprobs``; logprob tokens are text: joined they give the text, ``bytes`` joined give its
  UTF-8, ``text_offset`` points at each token;
- vLLM's extensions and OpenAI's other fields accepted; the ones the server ignores named in a header (a 400
  under ``serve.strict_fields``); a bad value of an implemented one a 400 naming it.
"""

import json
import math

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from specdec.serve.compat import IGNORED_HEADER
from tests.serve.conftest import LiveServer

MODEL = "tiny-random-llama"
MESSAGES = [{"role": "user", "content": "Say something about abcabc."}]
# a 4-choice item: a context and four continuations, as token ids (the tiny tokenizer: one token per byte)
CONTEXT = "Question: which is a fruit? Answer:"
CHOICES = [" apple", " stone", " chair", " cloud"]


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, endpoint, body, status=200):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)
    assert r.status_code == status, (body, r.status_code, r.text)
    return r


def valid_completion(body: dict, chunk: bool = False) -> Completion:
    """OpenAI's schema. Where OpenAI's API sends null and the package's types (which the client fills without
    validating) say otherwise, the entry is checked and filled: the echoed prompt's first token (null logprob,
    null top_logprobs) and a stream chunk's finish_reason before the last."""
    body = json.loads(json.dumps(body))
    for ch in body["choices"]:
        if chunk and ch["finish_reason"] is None:
            ch["finish_reason"] = "length"
        lp = ch.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            assert lp["top_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
            lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    return Completion.model_validate(body)


def sse(server, endpoint, body) -> list[dict]:
    """The data events of a streamed answer, up to [DONE]."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return events
                events.append(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended without [DONE]")


def check_token_text(text: str, lp: dict) -> None:
    """Completions' logprobs: tokens join to the text; each text_offset points at its token."""
    assert "".join(lp["tokens"]) == text
    assert len(lp["text_offset"]) == len(lp["tokens"])
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert text[off:off + len(tok)] == tok


def check_chat_token_text(content: str, lp) -> None:
    """Chat's logprobs: tokens join to the content, bytes join to its UTF-8."""
    assert "".join(t.token for t in lp.content) == content
    assert b"".join(bytes(t.bytes) for t in lp.content) == content.encode()


# plain_server / ngram_server: tests/serve/conftest.py


# ---------------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stream_with_continuous_usage_has_usage_on_every_chunk(plain_server, endpoint):
    """A load generator's stream: usage on every chunk, never falling, the last one equal to the unstreamed
    answer's usage (greedy: the same tokens)."""
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.0}
    body |= {"prompt": "The quick brown fox"} if endpoint == "completions" else {"messages": MESSAGES}
    want = post(plain_server, endpoint, body).json()["usage"]
    assert want["completion_tokens"] == 24
    events = sse(plain_server, endpoint, body | {"stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    for ev in events:
        valid_completion(ev, chunk=True) if endpoint == "completions" else ChatCompletionChunk.model_validate(ev)
        assert ev["usage"] is not None and ev["usage"]["prompt_tokens"] == want["prompt_tokens"]
        u = ev["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    made = [ev["usage"]["completion_tokens"] for ev in events]
    assert made == sorted(made) and made[-1] == 24 and events[-1]["usage"] == want
    assert events[-1]["choices"] == [] and len(events) > 3  # token by token, then the usage chunk
    # without continuous_usage_stats: usage null until the last chunk (OpenAI's include_usage)
    events = sse(plain_server, endpoint, body | {"stream": True, "stream_options": {"include_usage": True}})
    assert all(ev["usage"] is None for ev in events[:-1]) and events[-1]["usage"] == want


def test_openai_client_streams_with_continuous_usage(plain_server):
    """The unmodified openai client, with the vLLM option in stream_options."""
    c = client(plain_server)
    chunks = list(c.completions.create(model=MODEL, prompt="hello there", max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in chunks) and chunks[-1].usage.completion_tokens == 8


# ---------------------------------------------------------------------------------------------------- loglikelihood
def item_ids(server, item=(CONTEXT, CHOICES)) -> tuple[list[int], list[list[int]]]:
    """A harness's tokens: the context's, then each continuation's tokenized alone, appended."""
    tok = server.engine.tokenizer
    ctx = tok(item[0])["input_ids"]
    return ctx, [ctx + tok(c)["input_ids"] for c in item[1]]


def loglikelihoods(server, max_tokens: int, model=MODEL, item=(CONTEXT, CHOICES)) -> tuple[list[float], list[bool]]:
    """An evaluation harness's request (lm-eval's local-completions): the 4 choices batched as token ids,
    echo, logprobs=1, greedy; the score is the sum of the continuation's token logprobs."""
    ctx, prompts = item_ids(server, item)
    body = {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = post(server, "completions", body).json()
    valid_completion(r)
    choices = sorted(r["choices"], key=lambda ch: ch["index"])
    assert len(choices) == 4
    scores, greedy = [], []
    for ch, ids in zip(choices, prompts):
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        check_token_text(ch["text"], lp)
        end = len(ids)  # the prompt's tokens; with max_tokens=1 the generated one follows
        cont = lp["token_logprobs"][len(ctx):end]
        scores.append(math.fsum(cont))
        greedy.append(all(x == max(top.values()) for x, top in zip(cont, lp["top_logprobs"][len(ctx):end])))
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert r["usage"]["completion_tokens"] == 4 * max_tokens
    return scores, greedy


def prompt_logprob_sums(server, model=MODEL, item=(CONTEXT, CHOICES)) -> list[float]:
    """The same item through the server's own prompt_logprobs (vLLM's extension)."""
    ctx, prompts = item_ids(server, item)
    r = post(server, "completions", {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                     "prompt_logprobs": 0}).json()
    sums = []
    for ch, ids in zip(sorted(r["choices"], key=lambda ch: ch["index"]), prompts):
        plp = ch["prompt_logprobs"]
        sums.append(math.fsum(plp[i][str(ids[i])]["logprob"] for i in range(len(ctx), len(ids))))
    return sums


def test_loglikelihood_via_echo_equals_prompt_logprobs_and_is_lossless_under_speculation(plain_server, ngram_server):
    plain1, greedy1 = loglikelihoods(plain_server, 1)
    plain0, greedy0 = loglikelihoods(plain_server, 0)
    spec1, _ = loglikelihoods(ngram_server, 1)
    spec0, _ = loglikelihoods(ngram_server, 0)
    want = prompt_logprob_sums(plain_server)
    assert plain1 == plain0 == want  # bit for bit: the echo is the server's prompt_logprobs
    assert spec1 == spec0 == plain1  # n-gram speculation on and off: the same numbers
    assert prompt_logprob_sums(ngram_server) == want
    assert greedy1 == greedy0
    assert len(set(plain1)) == 4 and all(math.isfinite(x) and x < 0 for x in plain1)


def test_echo_shapes(plain_server):
    """echo without logprobs: the prompt's text, then the completion's; max_tokens=0: the prompt alone;
    streamed: the same text and tokens; a text prompt and a batch of them."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0}
    plain = post(plain_server, "completions", body).json()["choices"][0]["text"]
    r = valid_completion(post(plain_server, "completions", body | {"echo": True}).json())
    assert r.choices[0].text == "hello there" + plain
    r = post(plain_server, "completions", body | {"echo": True, "max_tokens": 0, "logprobs": 0}).json()
    valid_completion(r)
    ch = r["choices"][0]
    assert ch["text"] == "hello there" and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == len("hello there") and r["usage"]["completion_tokens"] == 0
    check_token_text(ch["text"], ch["logprobs"])
    # the same request streamed: one chunk (the prompt's logprobs come with the request's end), same content
    whole = post(plain_server, "completions", body | {"echo": True, "logprobs": 2}).json()["choices"][0]
    events = sse(plain_server, "completions", body | {"echo": True, "logprobs": 2, "stream": True})
    for ev in events:
        valid_completion(ev, chunk=True)
    text = "".join(ev["choices"][0]["text"] for ev in events if ev["choices"])
    toks = [t for ev in events if ev["choices"] for t in ev["choices"][0]["logprobs"]["tokens"]]
    assert text == whole["text"] == "hello there" + plain and "".join(toks) == text
    assert [x for ev in events for x in ev["choices"][0]["logprobs"]["token_logprobs"]] == \
        whole["logprobs"]["token_logprobs"]


@pytest.mark.slow
def test_smollm2_loglikelihood_via_echo_is_lossless_and_names_tokens_as_text():
    """The real default model: a 4-choice item scored through echo equals prompt_logprobs, bit for bit, with
    n-gram speculation off and on; the right answer wins; the echoed tokens are text (" Berlin", no "Ġ")."""
    from tests.serve.conftest import composed

    item = ("The capital of Germany is", [" Berlin", " Paris", " Rome", " Madrid"])
    model = "smollm2-135m-instruct"
    got = {}
    for name, overrides in (("plain", []), ("ngram", ["+experiment=ngram"])):
        srv = LiveServer(cfg=composed(*overrides, "max_model_len=512", "max_num_seqs=4",
                                      "serve.restart_on_failure=false"))
        try:
            got[name] = (loglikelihoods(srv, 1, model, item), loglikelihoods(srv, 0, model, item),
                         prompt_logprob_sums(srv, model, item))
            r = post(srv, "completions", {"model": model, "prompt": item[0] + item[1][0], "max_tokens": 0,
                                          "echo": True, "logprobs": 1}).json()["choices"][0]
            assert r["logprobs"]["tokens"][-1] == " Berlin" and not any("Ġ" in t for t in r["logprobs"]["tokens"])
            check_token_text(r["text"], r["logprobs"])
        finally:
            srv.stop()
    (one, greedy), (zero, _), want = got["plain"]
    assert one == zero == want and got["ngram"] == got["plain"]
    assert max(range(4), key=one.__getitem__) == 0  # " Berlin"
    print("SmolLM2 4-choice loglikelihoods (plain = ngram):", one, "greedy:", greedy)


# ---------------------------------------------------------------------------------------------------- token text
def test_chat_with_top_logprobs(plain_server):
    """A chat client asking for top_logprobs (the openai client, parsed into its types): tokens are text,
    bytes their UTF-8, the chosen token heads its alternatives (greedy)."""
    c = client(plain_server)
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                  top_logprobs=3)
    ChatCompletion.model_validate(r.model_dump())
    content, lp = r.choices[0].message.content, r.choices[0].logprobs
    assert len(lp.content) == 16
    check_chat_token_text(content, lp)
    for item in lp.content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == item.logprob
        if item.token:  # a token that completes no character yet has no text of its own
            assert item.top_logprobs[0].token == item.token
    # streamed: the same tokens across the chunks
    chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in lp.content]
    assert b"".join(bytes(t.bytes) for t in streamed) == content.encode()


def test_logprob_tokens_are_text_and_join_to_the_text(plain_server):
    """Token-id prompts, text prompts, batches, n > 1, sampling and a stop string: every completion's logprob
    tokens join to its text and top_logprobs hold each token under its own text."""
    tok = plain_server.engine.tokenizer
    bodies = [
        {"prompt": tok("abcabcabc")["input_ids"], "max_tokens": 24, "temperature": 0},  # token ids
        {"prompt": ["hello there", "The quick brown fox", [72, 105]], "max_tokens": 24, "temperature": 0},  # a batch
        {"prompt": "Once upon", "max_tokens": 32, "temperature": 1.0, "seed": 7, "n": 3},  # sampled, n=3
        {"prompt": "€ café 😊", "max_tokens": 16, "temperature": 0},  # multi-byte characters in the prompt
    ]
    seen_split = False
    for body in bodies:
        for echo in (False, True):
            r = post(plain_server, "completions", {"model": MODEL, "logprobs": 2, "echo": echo, **body}).json()
            valid_completion(r)
            for ch in r["choices"]:
                lp = ch["logprobs"]
                check_token_text(ch["text"], lp)
                for i, (t, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"])):
                    if top is not None:
                        assert top[t] == lp["token_logprobs"][i]
                seen_split |= "" in lp["tokens"]
    assert seen_split  # the tiny tokenizer splits every non-ASCII character: tokens with no text were met
    # a stop string: the text ends before it, the tokens are cut to the text
    free = post(plain_server, "completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 24,
                                              "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
    stop = next(c for c in free[1:] if c.isascii() and c.isprintable())  # ";" (the tiny model's output is noise)
    r = post(plain_server, "completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 24,
                                           "temperature": 0, "ignore_eos": True, "logprobs": 1, "stop": [stop]}).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["text"] == free[:free.index(stop)]
    check_token_text(ch["text"], ch["logprobs"])
    # vLLM's return_tokens_as_token_ids: tokens named by id
    r = post(plain_server, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0,
                                           "logprobs": 1, "return_tokens_as_token_ids": True}).json()
    assert all(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])


def test_best_of_returns_the_n_most_likely(plain_server):
    """best_of=4, n=2 (seeded): the 2 of the 4 seeded candidates with the highest cumulative logprob."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    all4 = post(plain_server, "completions", body | {"n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(all4, key=lambda ch: -math.fsum(ch["logprobs"]["token_logprobs"]))
    r = valid_completion(post(plain_server, "completions", body | {"n": 2, "best_of": 4}).json())
    assert [ch.text for ch in r.choices] == [ch["text"] for ch in ranked[:2]]
    assert [ch.index for ch in r.choices] == [0, 1] and r.choices[0].logprobs is None
    post(plain_server, "completions", body | {"n": 2, "best_of": 2})  # best_of == n: plain sampling


# ---------------------------------------------------------------------------------------------------- fields
VLLM_DEFAULTS = {  # what a vLLM client may send at its defaults: accepted, nothing ignored
    "use_beam_search": False, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "prompt_logprobs": None, "add_special_tokens": True, "response_format": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "priority": 0, "logits_processors": None, "return_tokens_as_token_ids": False,
    "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None, "user": "u-1", "suffix": None,
    "best_of": 1, "echo": False, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0,
    "stream_options": None,
}
CHAT_DEFAULTS = {
    "tools": None, "tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
    "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "n": 1, "logprobs": False, "top_logprobs": None,
    "max_completion_tokens": 8, "echo": False, "add_generation_prompt": True, "continue_final_message": False,
    "add_special_tokens": False, "documents": None, "chat_template": None, "chat_template_kwargs": None,
    "mm_processor_kwargs": None, "include_reasoning": True, "min_p": 0.05, "repetition_penalty": 1.1,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "seed": 3, "user": "u-1",
}


def test_known_fields_accepted_and_ignored_ones_named(plain_server):
    r = post(plain_server, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, **VLLM_DEFAULTS})
    valid_completion(r.json())
    assert IGNORED_HEADER not in r.headers
    r = post(plain_server, "chat/completions", {"model": MODEL, "messages": MESSAGES, **CHAT_DEFAULTS})
    ChatCompletion.model_validate(r.json())
    assert IGNORED_HEADER not in r.headers
    # fields asking for what the server does not do: served, and named in the header
    r = post(plain_server, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "priority": 5,
                                           "guided_whitespace_pattern": " ", "suffix": "!"})
    assert r.headers[IGNORED_HEADER] == "suffix, priority, guided_whitespace_pattern"
    r = post(plain_server, "chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                "tools": [{"type": "function", "function": {"name": "f"}}],
                                                "prediction": {"type": "content", "content": "x"}})
    assert r.headers[IGNORED_HEADER] == "tools, prediction"  # (response_format is implemented: test_response_format)
    # stream_options without stream does nothing (vLLM refuses it; some clients send it): served, and named
    r = post(plain_server, "chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                "stream_options": {"include_usage": True}})
    assert r.headers[IGNORED_HEADER] == "stream_options"
    # implemented vLLM fields take effect: the prompt truncated, the last message continued
    r = post(plain_server, "completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 2,
                                           "truncate_prompt_tokens": 3, "echo": True}).json()
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["text"].startswith("ere")
    r = post(plain_server, "chat/completions", {"model": MODEL, "max_tokens": 2, "add_generation_prompt": False,
                                                "continue_final_message": True, "messages": MESSAGES + [
                                                    {"role": "assistant", "content": "Well"}]})
    ChatCompletion.model_validate(r.json())


BAD = [  # (endpoint, body, the field the 400 names): implemented fields with bad values, fields of the other API
    ("completions", {"min_p": 2}, "min_p"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"add_special_tokens": "yes"}, "add_special_tokens"),
    ("completions", {"stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"best_of": 3, "stream": True}, "best_of"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("completions", {"truncation_side": "middle"}, "truncation_side"),
    ("completions", {"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("completions", {"skip_special_tokens": "no"}, "skip_special_tokens"),
    ("completions", {"echo": "true"}, "echo"),
    ("completions", {"tools": []}, "tools"),  # a chat field
    ("completions", {"bogus": 1}, "bogus"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
    ("chat/completions", {"suffix": "x"}, "suffix"),  # a completions field
    ("chat/completions", {"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
]


@pytest.mark.parametrize("endpoint,extra,field", BAD)
def test_bad_values_are_400_naming_the_field(plain_server, endpoint, extra, field):
    body = {"model": MODEL, **({"prompt": "hi"} if endpoint == "completions" else {"messages": MESSAGES}), **extra}
    err = post(plain_server, endpoint, body, status=400).json()["error"]
    assert err["param"] == field and field.split(".")[-1] in err["message"], err


def test_strict_fields_refuses_what_it_would_ignore():
    srv = LiveServer({"serve": {"strict_fields": True, "multiprocess": False}})
    try:
        err = post(srv, "completions", {"model": MODEL, "prompt": "hi", "priority": 1}, status=400).json()["error"]
        assert err["param"] == "priority" and "strict_fields" in err["message"]
        valid_completion(post(srv, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                   **VLLM_DEFAULTS}).json())  # neutral values still pass
    finally:
        srv.stop()
