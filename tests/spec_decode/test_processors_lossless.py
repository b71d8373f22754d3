"""Logits processors (penalties, logit_bias, allowed tokens, bad words, min_tokens) stay lossless under
speculation: the worker applies them at every scored position, conditioned on that position's drafted
prefix (specdec.sampling.sampler.logits_process.process_tree_logits), before verification.

1. Greedy: speculative output equals plain greedy output with the same SamplingParams, for each processor
   field alone and all together, through chains (n-gram, a draft model) and an EAGLE-2 tree.
2. Sampling: every generated token follows the *processed* target law (the randomised PIT of
   tests/spec_decode/test_sampling_lossless.py, recomputed here with the processors applied to the exact
   prefix of each token), 32 x 48 tokens, chi-square over 20 bins, p > 1e-3. Power: the same tokens scored
   against the unprocessed law are rejected with p < 1e-6.
"""

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.testing import rand_tokens
from specdec.sampling.logits_process import apply_processors
from tests.spec_decode.helpers import (DELTA, LOSSLESS_SPECS, ids, noisy_tiny_engine, pit_from_probs, target_forward,
                                       uniformity_pvalue)

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], rand_tokens(12, seed=1), [40, 41, 42, 43] * 4, rand_tokens(25, seed=2)]
FIELDS = {
    "repetition_penalty": {"repetition_penalty": 1.4},
    "presence_frequency": {"presence_penalty": 0.8, "frequency_penalty": 0.6},
    "logit_bias": {"logit_bias": {7: 2.5, 41: 3.0, 300: 4.0}},
    "allowed_token_ids": {"allowed_token_ids": list(range(0, 512, 3))},
    "min_tokens": {"min_tokens": 12, "stop_token_ids": [5, 6]},
    "all": {"repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.3,
            "logit_bias": {41: 2.0, 300: 3.0}, "min_tokens": 5, "stop_token_ids": [7]},
}
SPECS = LOSSLESS_SPECS


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256)


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("field", list(FIELDS))
def test_greedy_equal_with_processors(spec, field, plain):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **FIELDS[field])
    want = [o.outputs[0].token_ids for o in plain.generate(ids(PROMPTS), sp, use_tqdm=False)]
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=256, speculative_config=SPECS[spec]())
    got = [o.outputs[0].token_ids for o in llm.generate(ids(PROMPTS), sp, use_tqdm=False)]
    assert got == want, f"{spec} / {field}: speculative output differs from plain greedy"
    assert llm.get_metrics().num_draft_tokens > 0
    assert llm.engine.num_free_slots() == llm.engine.num_slots


def processed_pit(engine, prompts, outputs, sp: SamplingParams, gen: torch.Generator, processors: bool = True):
    """Randomised PIT of every generated token under the exact conditional law: the target's logits at its
    prefix, processed (or not) with ``sp``'s processors, then the temperature."""
    us = []
    for prompt, out in zip(prompts, outputs):
        full = prompt + out
        logits = target_forward(engine, full[:-1]).logits[len(prompt) - 1:]  # [len(out), V]
        if processors:
            prefixes = [full[:len(prompt) + i] for i in range(len(out))]
            logits = apply_processors(logits, prefixes, [len(prompt)] * len(out), [sp] * len(out))
        p = torch.softmax(logits.double() / sp.temperature, -1)
        us.append(pit_from_probs(p, torch.tensor(out), gen))
    return torch.cat(us)


PIT_PROMPTS = [rand_tokens(3 + 5 * (i % 7), seed=200 + i) for i in range(32)]


PIT_SPECS = {  # drafts that get accepted at T = 0.8 on the tiny model (n-gram hardly ever is)
    "draft_noisy_k3": lambda: {"method": "draft_model", "num_speculative_tokens": 3,
                               "options": {"engine": noisy_tiny_engine(0.15, num_slots=32)}},
    "layer_skip_k3": lambda: {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("spec", list(PIT_SPECS))
def test_every_token_follows_the_processed_target(spec, plain):
    sp = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=None, repetition_penalty=1.6,
                        presence_penalty=0.7, frequency_penalty=0.5, logit_bias={7: 3.0, 41: 3.0, 300: 4.0})
    llm = LLM("tiny-random-llama", max_num_seqs=32, max_model_len=128, speculative_config=PIT_SPECS[spec]())
    torch.manual_seed(0)
    outs = [o.outputs[0].token_ids for o in llm.generate(ids(PIT_PROMPTS), sp, use_tqdm=False)]
    m = llm.get_metrics()
    assert m.num_accepted_tokens > 0, "nothing was accepted: the test would not exercise verification"
    u = processed_pit(plain.engine, PIT_PROMPTS, outs, sp, torch.Generator().manual_seed(0))
    pval = uniformity_pvalue(u)
    assert pval > DELTA, f"{spec}: PIT p-value {pval:.2e} over {u.numel()} tokens (tau {m.mean_acceptance_length:.2f})"
    wrong = processed_pit(plain.engine, PIT_PROMPTS, outs, sp, torch.Generator().manual_seed(0), processors=False)
    assert uniformity_pvalue(wrong) < 1e-6, "the check has no power: the processors barely change the law"
