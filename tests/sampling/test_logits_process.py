"""Logits processors (specdec/sampling/logits_process.py) against a per-element reference, and the new
SamplingParams fields end to end on the tiny model (plain decoding; refused under speculation)."""

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.sampling.logits_process import MASKED, apply_processors


def reference(logits, prefixes, prompt_lens, params):
    """One element at a time, straight from the definitions in the module docstring."""
    out = logits.clone()
    for i, p in enumerate(params):
        output = list(prefixes[i][prompt_lens[i]:])
        for t in range(out.shape[1]):
            x = float(out[i, t])
            if p.repetition_penalty != 1.0 and t in prefixes[i]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            c = output.count(t)
            x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            x += (p.logit_bias or {}).get(t, 0.0)
            masked = p.allowed_token_ids is not None and t not in p.allowed_token_ids
            for w in p.bad_words_token_ids or []:
                n = len(w) - 1
                if w[-1] == t and (n == 0 or output[len(output) - n:] == w[:-1]):
                    masked = True
            if len(output) < p.min_tokens and t in p.stop_token_ids + [getattr(p, "_eos_token_id", None)]:
                masked = True
            out[i, t] = MASKED if masked else x
    return out


def test_apply_processors_matches_reference():
    g = torch.Generator().manual_seed(0)
    V = 12
    logits = torch.randn(5, V, generator=g) * 3
    prefixes = [[1, 2, 3, 4, 4, 5], [7, 7, 7, 1], [0, 1, 2], [3, 9, 9, 2, 3], [5]]
    prompt_lens = [3, 1, 3, 2, 1]
    eos = SamplingParams(min_tokens=3, max_tokens=8, stop_token_ids=[6])
    eos._eos_token_id = 11
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.7),
        SamplingParams(logit_bias={0: 5.0, 3: -100.0}, allowed_token_ids=[0, 1, 3, 7]),
        SamplingParams(),  # untouched
        SamplingParams(bad_words_token_ids=[[9, 2, 3], [4], [9, 8]], frequency_penalty=2.0),
        eos,
    ]
    got = apply_processors(logits, prefixes, prompt_lens, params)
    torch.testing.assert_close(got, reference(logits, prefixes, prompt_lens, params))
    assert torch.equal(got[2], logits[2]) and not torch.equal(got, logits)
    assert got.sum(dim=-1).isfinite().all()  # masks stay finite: the sampler would call -inf a broken row


def test_no_processor_returns_input_unchanged():
    logits = torch.randn(2, 5)
    assert apply_processors(logits, [[1], [2]], [1, 1], [SamplingParams(), SamplingParams()]) is logits


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=128)


GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_allowed_and_bias_and_bad_words_end_to_end(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate(prompt, SamplingParams(**GREEDY, allowed_token_ids=[40, 41]), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= {40, 41}
    out = llm.generate(prompt, SamplingParams(**GREEDY, logit_bias={77: 100.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [77] * 12
    plain = llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    banned = plain[0]
    out = llm.generate(prompt, SamplingParams(**GREEDY, bad_words_token_ids=[[banned]]), use_tqdm=False)[0]
    assert banned not in out.outputs[0].token_ids


def test_min_tokens_keeps_eos_away(llm):
    eos = llm.tokenizer.eos_token_id
    prompt = {"prompt_token_ids": [5, 6, 7]}
    # biasing EOS up makes it the greedy choice at once; min_tokens holds it off for 5 tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0}, min_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:5]


def test_stop_strings_and_n(llm):
    prompt = "hello"
    ascii_ids = llm.tokenizer("abcdefghijklmnop", add_special_tokens=False)["input_ids"]  # readable text
    base = dict(GREEDY, allowed_token_ids=ascii_ids)
    full = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    # the first 2-character string that has not appeared before its position
    i = next(i for i in range(2, 10) if full.text[i:i + 2] not in full.text[:i + 1])
    stop = full.text[i:i + 2]
    cut = llm.generate(prompt, SamplingParams(**base, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 12
    kept = llm.generate(prompt, SamplingParams(**base, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(stop) and kept.text[:-len(stop)] == cut.text
    # n: children seeded seed + i; greedy children are all the same, seeded ones reproducible
    outs = llm.generate(prompt, SamplingParams(max_tokens=6, n=3, seed=7, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in outs.outputs] == [0, 1, 2]
    again = [llm.generate(prompt, SamplingParams(max_tokens=6, seed=7 + i, ignore_eos=True), use_tqdm=False)[0]
             for i in range(3)]
    assert [c.token_ids for c in outs.outputs] == [a.outputs[0].token_ids for a in again]


def test_latency_fields(llm):
    out = llm.generate("abc", SamplingParams(**GREEDY), use_tqdm=False)[0]
    m, lat = out.metrics, out.latency
    assert None not in (m.scheduler_time, m.model_forward_time, m.model_execute_time, m.first_token_time)
    assert lat.ttft > 0 and lat.tpot > 0 and len(lat.itl) == 11 and all(x >= 0 for x in lat.itl)


def test_processors_under_speculation_are_refused_or_lossless():
    """Until the verifier applies processors per drafted position a speculative engine refuses them, naming
    the field and the way out; once it does, greedy output with them equals plain decoding's."""
    spec = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5, repetition_penalty=1.3,
                            logit_bias={40: 3.0}, ignore_eos=True)
    try:
        got = spec.generate("abcabcabc", params, use_tqdm=False)[0].outputs[0].token_ids
    except ValueError as e:
        assert "presence_penalty" in str(e) and "use plain decoding for now" in str(e)
    else:
        want = spec.without_speculation().generate("abcabcabc", params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
    # fields that do not change the distribution are fine
    out = spec.generate("abcabc", SamplingParams(temperature=0, max_tokens=6, n=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    # stop strings under speculation: the same cut as plain decoding, though a step emits several tokens
    plain = spec.without_speculation()
    ascii_text = plain.generate("abcabcabc", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    for stop in {ascii_text.text[i:i + 1] for i in range(3, 12)} - {""}:
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        a = spec.generate("abcabcabc", p, use_tqdm=False)[0].outputs[0]
        b = plain.generate("abcabcabc", p, use_tqdm=False)[0].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)


def test_sampler_with_processors_samples_the_processed_distribution():
    """Statistical check (as tests/sampling/test_sampler.py's): with penalties, logit_bias and a mask on, the sampler's
    draws follow softmax(apply_processors(logits) / T); logprobs stay those of the raw logits."""
    from specdec_kernels.testing import chi_square_pvalue, counts_of, tv_distance
    from specdec.sampling.sampler import Sampler
    from specdec.datamodel.sequence import SequenceData

    V, N, T = 16, 40_000, 0.8
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=T, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3,
                            logit_bias={3: 2.0, 5: -1.5}, bad_words_token_ids=[[7]])
    data = SequenceData.from_seqs([1, 2, 3], [3, 4, 4, 9])
    expected = torch.softmax(apply_processors(logits[None], [data.get_token_ids()], [3], [params])[0] / T, -1)
    out = Sampler()(logits.expand(N, V).contiguous(), [params] * N, seq_data=[data] * N)
    counts = counts_of(out.token_ids, V)
    assert counts[7] == 0  # the bad word never appears
    assert tv_distance(counts, expected) < 0.01 and chi_square_pvalue(counts, expected) > 1e-3
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs[:50], raw[out.token_ids[:50]])


FIELD_CASES = [  # every new SamplingParams field, one at a time, greedy
    dict(n=2), dict(stop=["a"]), dict(stop=["a"], include_stop_str_in_output=True), dict(skip_special_tokens=False),
    dict(prompt_logprobs=2), dict(min_tokens=5), dict(presence_penalty=0.8), dict(frequency_penalty=0.6),
    dict(repetition_penalty=1.5), dict(logit_bias={40: 4.0}), dict(allowed_token_ids=list(range(30, 90))),
    dict(bad_words_token_ids=[[44], [40, 41]]),
]


@pytest.mark.parametrize("fields", FIELD_CASES, ids=lambda f: ",".join(f))
def test_each_new_field_greedy_equal_with_and_without_speculation(fields, llm):
    spec = llm.with_speculation({"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=20, **fields)
    prompt = "abcabcabc abcabc"
    plain_out = llm.generate(prompt, params, use_tqdm=False)[0]
    try:
        spec_out = spec.generate(prompt, params, use_tqdm=False)[0]
    except ValueError as e:  # processors refused under speculation (until the verifier applies them)
        assert "use plain decoding for now" in str(e)
        return
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in spec_out.outputs] == \
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in plain_out.outputs]
    assert spec_out.prompt_logprobs == plain_out.prompt_logprobs
