"""Greedy equality on the real default model, SmolLM2-135M-Instruct (slow): ngram (mqa and
batch_expansion) and layer_skip (first 8 of 30 layers) give token-identical greedy output to plain
decoding, at batch 1 and in a ragged batch of 4 chat prompts (<= 48 new tokens each, to keep CI time
down). One target engine is loaded once and shared by every configuration (``LLM.with_speculation``).
A mismatch fails with the target's top-2 logit gap at the first differing token (near-tie or bug).
"""

import pytest

from specdec import LLM, SamplingParams
from tests.spec_decode.helpers import assert_greedy_equal, ids

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",  # n-gram friendly
    "List three prime numbers.",
    "Summarize: Paris is the capital of France. Paris is known for the Eiffel Tower and the Louvre.",
    "What is 12 times 12?",
]
RAGGED_MAX = [48, 24, 40, 16]

CONFIGS = {
    "ngram_mqa": {"method": "ngram", "num_speculative_tokens": 3, "scorer": "mqa"},
    "ngram_batch_expansion": {"method": "ngram", "num_speculative_tokens": 3, "scorer": "batch_expansion"},
    "layer_skip8_mqa": {"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3, "scorer": "mqa"},
}


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def cases(smol):
    """name -> (prompt ids, params, plain greedy outputs), computed once."""
    prompts = [smol.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    out = {}
    for name, ps, maxes in (("batch1", prompts[:1], [48]), ("ragged4", prompts, RAGGED_MAX)):
        sp = [SamplingParams(temperature=0, max_tokens=m) for m in maxes]
        out[name] = (ps, sp, smol.generate(ids(ps), sp, use_tqdm=False))
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equal_to_plain_on_smollm2(config, smol, cases):
    llm = smol.with_speculation(CONFIGS[config])
    for name, (prompts, sp, ref) in cases.items():
        outs = llm.generate(ids(prompts), sp, use_tqdm=False)
        assert_greedy_equal(smol.engine, prompts, outs, ref, f"SmolLM2 {config}/{name}")
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, f"{config}: nothing speculated or accepted"
    assert smol.engine.num_free_slots() == smol.engine.num_slots
