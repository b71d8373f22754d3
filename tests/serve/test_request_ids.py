"""Client request ids are only echoed (#46): the server forms "{id}-{i}" per prompt and the engine once named a
parent's children "{i}_{parent}", so "0_R" collided with R's first child (it got R's tokens, R's client hung)
and a repeated id was a 500. Now the engine core sees the front end's own ids: every such request is served
as itself, over HTTP, with its id echoed."""

import json
import threading

import httpx

from specdec import LLM, SamplingParams
from tests.serve.conftest import LiveServer


def test_colliding_and_repeated_request_ids_are_distinct_requests():
    srv = LiveServer({"serve": {"multiprocess": False}})
    try:
        url = srv.url + "/v1/completions"
        first = {}

        def parent():  # R, n=2, streamed: still running while the others arrive
            body = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "n": 2, "request_id": "R", "stream": True}
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                first["status"] = r.status_code
                first["lines"] = [x for x in r.iter_lines() if x.startswith("data: {")]

        t = threading.Thread(target=parent)
        t.start()
        got = {}
        for rid, prompt in (("0_R", "abcabcabc"), ("R", "why?"), ("1_R-0", "why?")):
            r = httpx.post(url, json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "request_id": rid},
                           timeout=60)
            assert r.status_code == 200, (rid, r.status_code, r.text)
            got[rid] = r.json()
        t.join(60)
        assert not t.is_alive() and first["status"] == 200
    finally:
        srv.stop()
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256)
    want = {p: llm.generate(p, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
            for p in ("abcabcabc", "why?")}
    chunks = [json.loads(x[len("data: "):]) for x in first["lines"]]
    texts = ["".join(c["text"] for ch in chunks for c in ch["choices"] if c["index"] == i) for i in (0, 1)]
    hello = llm.generate("hello", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    assert texts == [hello, hello] and all(ch["id"] == "R" for ch in chunks)  # greedy: both choices alike
    for rid, prompt in (("0_R", "abcabcabc"), ("R", "why?"), ("1_R-0", "why?")):
        assert got[rid]["id"] == rid and got[rid]["choices"][0]["text"] == want[prompt], rid
