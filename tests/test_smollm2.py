"""End to end on the real default model, SmolLM2-135M-Instruct (slow: converts the GGUF once)."""

import pytest
import torch

from specdec import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from specdec.engine.loader import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-135m-instruct"),
                                                dtype=torch.float32).eval()


def test_greedy_is_token_identical_to_transformers_generate_ragged_batch(smol, hf_model):
    ids = [smol.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    max_tokens = [24, 40, 32, 16]  # ragged: different prompt lengths and max_tokens in one batch
    outs = smol.generate([{"prompt_token_ids": i} for i in ids],
                         [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    for i, out in enumerate(outs):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids[i]]), max_new_tokens=max_tokens[i], do_sample=False,
                                    pad_token_id=smol.tokenizer.eos_token_id)
        assert out.outputs[0].token_ids == ref[0, len(ids[i]):].tolist(), PROMPTS[i]
    assert smol.engine.num_free_slots() == smol.engine.num_slots


def test_chat_produces_text(smol):
    out = smol.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=20),
                    use_tqdm=False)[0]
    assert "4" in out.outputs[0].text
