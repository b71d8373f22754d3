"""The server on the real default model, SmolLM2-135M-Instruct (slow): greedy chat and completions through the
openai client equal LLM.chat / LLM.generate, with n-gram speculation, streaming and not."""

import openai
import pytest

from specdec import LLM, SamplingParams
from tests.serve.conftest import NGRAM, LiveServer

pytestmark = pytest.mark.slow

SMOL = {"model": {"_target_": "specdec.llm.LLM", "name": "smollm2-135m-instruct", "dtype": "float32"},
        "max_model_len": 512}
MESSAGES = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]


def test_smollm2_ngram_server_matches_llm():
    llm = LLM("smollm2-135m-instruct", max_num_seqs=2, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=32)
    want_chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    want_text = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    del llm
    srv = LiveServer({**SMOL, **NGRAM})
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == want_chat
        s = c.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=32, temperature=0,
                                      stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == want_chat
        r = c.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=32,
                                 temperature=0)
        assert r.choices[0].text == want_text
    finally:
        srv.stop()
