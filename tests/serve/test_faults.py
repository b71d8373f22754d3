"""Faults through the server: bad requests are 400s naming the field (never 500) while other requests run
undisturbed; the API key guards every /v1 route; a client that disconnects mid-stream is aborted in the
core; a killed engine core fails its in-flight requests, /health reports it, and the restarted core serves."""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from tests.serve.conftest import LiveServer

LONG = "Tell me a long story about the sea and the wind and the sky."


def ref_text(prompt, max_tokens):
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0].text


BAD = [  # (endpoint, raw body, the field the 400 must name)
    ("completions", b'{"prompt": "x", "max_tokens": ', None),  # malformed JSON
    ("completions", b'{"prompt": "x", "bogus": 1}', "bogus"),
    ("completions", b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),
    ("completions", b'{"prompt": "x", "temperature": -1}', "temperature"),
    ("completions", b'{"prompt": "x", "top_p": 0}', "top_p"),
    ("completions", b'{"prompt": "x", "n": 0}', "n"),
    ("completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("completions", b'{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias"),
    ("completions", b'{"prompt": "x", "logit_bias": {"99999": 1}}', "logit_bias"),
    ("completions", b'{"prompt": [1, 2, 99999]}', "prompt"),
    ("completions", b'{"prompt": [1.5]}', "prompt"),
    ("completions", b'{"prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
    ("completions", b'{"prompt": "x", "min_tokens": 50, "max_tokens": 5}', "min_tokens"),
    ("completions", b'{"prompt": "' + b"a" * 300 + b'"}', "prompt"),  # over the 256-token context
    ("completions", b'{"prompt": "x", "max_tokens": 1000}', "max_tokens"),  # prompt + output over the context
    ("completions", b'{"prompt": "x", "model": "gpt-4"}', "model"),
    ("completions", b'{"max_tokens": 3}', "prompt"),
    ("completions", b'[1, 2]', None),
    ("completions", b'', None),
    ("chat/completions", b'{"messages": [{"role": "user"}], "stop": 3}', "stop"),
    ("chat/completions", b'{"messages": "hi"}', "messages"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi", "x": 1}]}', "messages[0].x"),
    ("chat/completions", b'{"messages": [], "max_tokens": 2}', "messages"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage"),
]


def test_bad_requests_are_400_naming_the_field_and_others_run_on(plain_server):
    want = ref_text(LONG, 48)
    got = {}

    def long_request():
        c = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="x", max_retries=0)
        s = c.completions.create(model="tiny-random-llama", prompt=LONG, max_tokens=48, temperature=0, stream=True)
        got["text"] = "".join(ch.choices[0].text for ch in s if ch.choices)

    t = threading.Thread(target=long_request)
    t.start()
    for endpoint, body, field in BAD:
        r = httpx.post(f"{plain_server.url}/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if field is not None:
            assert err["param"].startswith(field) and field.split(".")[-1].split("[")[0] in err["message"], (body, err)
    t.join(60)
    assert got["text"] == want


def test_api_key_on_every_v1_route(monkeypatch):
    monkeypatch.setenv("SPECDEC_API_KEY", "s3cret")
    srv = LiveServer({"serve": {"multiprocess": False}})
    try:
        for method, path in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions")):
            r = getattr(httpx, method)(srv.url + path, **({"json": {"prompt": "x"}} if method == "post" else {}))
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open; metrics and docs need the key
        for path in ("/metrics", "/docs", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 401
            assert httpx.get(srv.url + path, headers={"authorization": "Bearer s3cret"}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="tiny-random-llama", prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        srv.stop()


def test_disconnect_mid_stream_aborts_and_others_are_unchanged(plain_server):
    want = ref_text("hello there", 40)
    engine = plain_server.engine
    loop = server_loop(plain_server)
    aborted_before = asyncio.run_coroutine_threadsafe(engine.get_stats(), loop).result(10)["num_aborted"]
    other = {}

    def other_request():
        c = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="x", max_retries=0)
        s = c.completions.create(model="tiny-random-llama", prompt="hello there", max_tokens=40, temperature=0,
                                 stream=True)
        other["text"] = "".join(ch.choices[0].text for ch in s if ch.choices)

    t = threading.Thread(target=other_request)
    t.start()
    body = {"prompt": "x", "max_tokens": 250, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", plain_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        # closed mid-stream: Starlette cancels the response, the request is aborted in the core
    t.join(60)
    assert other["text"] == want
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = asyncio.run_coroutine_threadsafe(engine.get_stats(), loop).result(10)
        if stats["num_running_reqs"] == 0 and engine.num_in_flight() == 0:
            break
        time.sleep(0.05)
    assert stats["num_running_reqs"] == 0 and engine.num_in_flight() == 0
    assert stats["num_aborted"] == aborted_before + 1


def server_loop(server):
    """The event loop the test server runs on (uvicorn's, in its thread)."""
    return server.engine._output_task.get_loop()


def test_killed_core_errors_in_flight_health_reports_and_restart_serves():
    srv = LiveServer({})
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        before = c.completions.create(model="tiny-random-llama", prompt="hello", max_tokens=8, temperature=0)
        old_pid = srv.engine.client.pid
        result = {}

        def in_flight():
            try:
                c.completions.create(model="tiny-random-llama", prompt="x", max_tokens=250, temperature=0,
                                     extra_body={"ignore_eos": True})
                result["status"] = 200
            except openai.APIStatusError as e:
                result["status"] = e.status_code
                result["body"] = e.response.text

        t = threading.Thread(target=in_flight)
        t.start()
        deadline = time.monotonic() + 30
        while srv.engine.num_in_flight() == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(old_pid, signal.SIGKILL)
        t.join(60)
        assert result["status"] == 503 and "engine core" in json.loads(result["body"])["error"]["message"]
        srv.wait_health(503, timeout=10)
        srv.wait_health(200, timeout=180)  # restarted in the background
        assert srv.engine.client.pid != old_pid
        running = [line for line in httpx.get(srv.url + "/metrics").text.splitlines()
                   if line.startswith("specdec_num_requests_running{")]
        assert running and running[0].endswith(" 0.0"), running  # not the dead core's last count
        after = c.completions.create(model="tiny-random-llama", prompt="hello", max_tokens=8, temperature=0)
        assert after.choices[0].text == before.choices[0].text
        assert "specdec_engine_core_restarts_total" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()


def test_disconnect_before_a_non_streaming_answer_aborts(plain_server):
    """Deterministic whatever the machine's speed: the engine core is paused (SIGSTOP) while the request is
    in flight, the client hangs up, and only then does the core go on; it must abort, not finish."""
    import socket
    from urllib.parse import urlparse

    engine = plain_server.engine
    loop = server_loop(plain_server)
    before = asyncio.run_coroutine_threadsafe(engine.get_stats(), loop).result(10)["num_aborted"]
    body = json.dumps({"prompt": "x", "max_tokens": 250, "temperature": 0, "ignore_eos": True}).encode()
    url = urlparse(plain_server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    pid = engine.client.pid
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 20
        while engine.num_in_flight() == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pid, signal.SIGSTOP)  # the request cannot finish while the client hangs up
    finally:
        sock.close()
    try:
        deadline = time.monotonic() + 20
        while engine.num_in_flight() and time.monotonic() < deadline:  # the front end saw the disconnect
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = asyncio.run_coroutine_threadsafe(engine.get_stats(), loop).result(10)
        if stats["num_aborted"] > before and engine.num_in_flight() == 0:
            break
        time.sleep(0.05)
    assert stats["num_aborted"] == before + 1 and stats["num_running_reqs"] == 0


