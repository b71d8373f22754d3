"""The server on the real default model, SmolLM2-135M-Instruct (slow): greedy chat and completions through the
openai client equal LLM.chat / LLM.generate built from the same composed config, for n-gram and EAGLE (tree)
speculation, streaming and not."""

import openai
import pytest

from specdec.serve import engine_args_from, split_config
from specdec.datamodel.sampling_params import SamplingParams
from tests.serve.conftest import LiveServer, composed

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]
PROMPT = "The capital of France is"


@pytest.mark.parametrize("experiment", ["ngram", "eagle"])
def test_smollm2_server_matches_llm(experiment):
    cfg = composed(f"+experiment={experiment}", "max_model_len=512", "max_num_seqs=2", "serve.restart_on_failure=false")
    llm = engine_args_from(split_config(cfg)[1], multiprocess=False).create_llm()
    params = SamplingParams(temperature=0, max_tokens=32)
    want_chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    want_text = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    del llm
    srv = LiveServer(cfg=cfg)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        model = "smollm2-135m-instruct"
        r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == want_chat
        s = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=32, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == want_chat
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0)
        assert r.choices[0].text == want_text
    finally:
        srv.stop()
