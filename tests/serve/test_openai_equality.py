"""Through the server, with the official openai client, greedy output equals LLM.generate / LLM.chat:
plain and n-gram speculation, streaming and not; usage and include_usage; speculative /metrics counters."""

import openai
import pytest

from specdec import LLM, SamplingParams

PROMPTS = ["hello there", "abcabcabcabc", "The quick brown fox"]
MESSAGES = [{"role": "user", "content": "Say something about abcabc."}]
MAX_TOKENS = 16


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def reference(spec):
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    return texts, chat


@pytest.mark.parametrize("which,spec", [("plain_server", None),
                                        ("ngram_server", {"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
                                        ("draft_server", {"method": "draft_model", "model": "tiny-random-llama",
                                                          "num_speculative_tokens": 3})])
def test_greedy_equality_streaming_and_not(request, which, spec):
    server = request.getfixturevalue(which)
    texts, chat_text = reference(spec)
    c = client(server)
    model = c.models.list().data[0].id
    assert model == "tiny-random-llama"
    for prompt, want in zip(PROMPTS, texts):
        r = c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices
    # a batch of prompts in one request: choices in prompt order
    r = c.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda x: x.index)] == texts
    r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == chat_text and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat_text


def test_speculative_counters_in_metrics(ngram_server):
    import httpx

    c = client(ngram_server)
    c.completions.create(model="tiny-random-llama", prompt="abcabcabcabcabc", max_tokens=24, temperature=0)
    text = httpx.get(ngram_server.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    drafts = [v for k, v in values.items() if k.startswith("specdec_spec_decode_num_draft_tokens_total")]
    assert drafts and drafts[0] > 0
    accepted = sum(v for k, v in values.items() if k.startswith("specdec_spec_decode_num_accepted_tokens_total"))
    per_pos = sum(v for k, v in values.items()
                  if k.startswith("specdec_spec_decode_num_accepted_tokens_per_pos_total"))
    assert accepted == per_pos
    assert any(k.startswith("specdec_time_to_first_token_seconds_count") and v > 0 for k, v in values.items())
    assert values['specdec_engine_core_alive{model_name="tiny-random-llama"}'] == 1.0
    steps = values['specdec_spec_decode_draft_tokens_per_request_count{model_name="tiny-random-llama"}']
    assert steps > 0 and values['specdec_spec_decode_draft_tokens_per_request_sum{model_name="tiny-random-llama"}'] \
        == drafts[0]  # every draft token counted once, in the request-step that drafted it


def test_num_speculative_tokens_switches_speculation_off_per_request(ngram_server):
    """The extra field num_speculative_tokens (SamplingParams'): 0 = no drafts for this request, same text."""
    import httpx

    def drafted() -> float:
        text = httpx.get(ngram_server.url + "/metrics").text
        return sum(float(line.split(" ")[1]) for line in text.splitlines()
                   if line.startswith("specdec_spec_decode_num_draft_tokens_total"))

    c = client(ngram_server)
    kw = dict(model="tiny-random-llama", prompt="abcabcabcabcabc", max_tokens=24, temperature=0)
    before = drafted()
    off = c.completions.create(**kw, extra_body={"num_speculative_tokens": 0})
    assert drafted() == before
    on = c.completions.create(**kw)
    assert drafted() > before and on.choices[0].text == off.choices[0].text
    with pytest.raises(Exception, match="num_speculative_tokens"):
        c.completions.create(**kw, extra_body={"num_speculative_tokens": -1})


def test_parameters_pass_through(plain_server):
    c = client(plain_server)
    r = c.completions.create(model="tiny-random-llama", prompt="hi", max_tokens=6, n=2, seed=3, temperature=1.0,
                             logprobs=2, extra_body={"top_k": 20, "ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert all(len(ch.logprobs.tokens) == 6 for ch in r.choices)
    r2 = c.completions.create(model="tiny-random-llama", prompt="hi", max_tokens=6, n=2, seed=3, temperature=1.0,
                              logprobs=2, extra_body={"top_k": 20, "ignore_eos": True})
    assert [ch.text for ch in r.choices] == [ch.text for ch in r2.choices]  # seeded: reproducible
    # a logit bias through the API: token 77 forced
    r = c.completions.create(model="tiny-random-llama", prompt="hi", max_tokens=4, temperature=0,
                             logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    ref = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=64).generate(
        "hi", SamplingParams(temperature=0, max_tokens=4, logit_bias={77: 100.0}, ignore_eos=True), use_tqdm=False)
    assert r.choices[0].text == ref[0].outputs[0].text


def test_logprob_token_ids_join_top_logprobs(ngram_server):
    """``logprob_token_ids`` (an extra, as vLLM's) under n-gram speculation: each emitted token's top_logprobs
    hold the top n and the asked ids, with the values LLM.generate reports (plain: the same dicts)."""
    ids = [43, 300]
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256)
    c = client(ngram_server)
    prompt = "abcabcabcabc"
    r = c.completions.create(model="tiny-random-llama", prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                             extra_body={"logprob_token_ids": ids, "ignore_eos": True,
                                         "return_tokens_as_token_ids": True})  # tokens named by id (vLLM's)
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=2, logprob_token_ids=ids,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    got = r.choices[0].logprobs.top_logprobs
    assert len(got) == len(ref.logprobs) == 8
    for g, d in zip(got, ref.logprobs):
        assert g == pytest.approx({f"token_id:{t}": x.logprob for t, x in d.items()}, abs=1e-4)
    chat = c.chat.completions.create(model="tiny-random-llama", messages=MESSAGES, max_tokens=4, temperature=0,
                                     logprobs=True, top_logprobs=2,
                                     extra_body={"logprob_token_ids": ids, "return_tokens_as_token_ids": True})
    for item in chat.choices[0].logprobs.content:
        tops = [t.token for t in item.top_logprobs]
        assert len(tops) >= 2 and {f"token_id:{t}" for t in ids} <= set(tops) | {item.token}
    with pytest.raises(openai.BadRequestError, match="logprob_token_ids"):
        c.completions.create(model="tiny-random-llama", prompt=prompt, max_tokens=2, logprobs=1,
                             extra_body={"logprob_token_ids": [10**6]})
