"""Issue #46's probes, replayed as a hostile client against a REAL server process (``python -m specdec.serve``
on the tiny random model, its key in the environment): every probe is answered 4xx (never 5xx, never a hang),
``/health`` answers throughout (within 100 ms while a 5 MB body and a 1.9 MB prompt are refused), a greedy
bystander streaming alongside gets the very tokens it gets alone, no request's tokens reach another's answer,
and the server is healthy afterwards."""

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
KEY = "hostile-test-key"
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
BYSTANDER = {"prompt": "The sea and the wind", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    cwd = tmp_path_factory.mktemp("serve")  # whatever the server writes lands here, not in the repository
    env = {**os.environ, "SPECDEC_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "specdec.serve", "model=tiny", "max_model_len=256", "max_num_seqs=4",
                             f"serve.port={port}", "serve.log_level=warning"], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start in 240 s")
        time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def complete(url: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(url: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


class HealthWatch:
    """GET /health every 20 ms in a thread: (start time, seconds, status) per poll."""

    def __init__(self, url: str) -> None:
        self.url, self.polls, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = None
                self.polls.append((t0, time.monotonic() - t0, status))
                time.sleep(0.02)

    def between(self, t0: float, t1: float) -> list[float]:
        return [dt for t, dt, _ in self.polls if t0 <= t <= t1]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)


# (name, endpoint, body: dict or raw bytes, extra headers, expected status, the field the error must name)
DEEP = b"[" * 5000 + b"]" * 5000
PROBES = [
    ("logprob_token_ids without a cap", "completions", {"prompt": "x", "logprob_token_ids": list(range(256)) * 20},
     {}, 400, "logprob_token_ids"),
    ("bad_words without a cap", "completions", {"prompt": "x", "bad_words": [f"w{i}" for i in range(5000)]},
     {}, 400, "bad_words"),
    ("a long bad word", "completions", {"prompt": "x", "bad_words": ["a" * 5000]}, {}, 400, "bad_words"),
    ("n", "completions", {"prompt": "x", "n": 1000}, {}, 400, "n"),
    ("best_of", "completions", {"prompt": "x", "best_of": 100}, {}, 400, "best_of"),
    ("logprobs", "completions", {"prompt": "x", "logprobs": 1000}, {}, 400, "logprobs"),
    ("prompt_logprobs", "completions", {"prompt": "x", "prompt_logprobs": 1000}, {}, 400, "prompt_logprobs"),
    ("chat top_logprobs", "chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                               "top_logprobs": 1000}, {}, 400, "top_logprobs"),
    ("batch size", "completions", {"prompt": ["x"] * 1000}, {}, 400, "prompt"),
    ("stop strings", "completions", {"prompt": "x", "stop": [f"s{i}" for i in range(1000)]}, {}, 400, "stop"),
    ("a long stop string", "completions", {"prompt": "x", "stop": "s" * 5000}, {}, 400, "stop"),
    ("stop_token_ids", "completions", {"prompt": "x", "stop_token_ids": [1] * 5000}, {}, 400, "stop_token_ids"),
    ("allowed_token_ids", "completions", {"prompt": "x", "allowed_token_ids": [1] * 100000}, {}, 400,
     "allowed_token_ids"),
    ("logit_bias entries", "completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(5000)}}, {}, 400,
     "logit_bias"),
    ("request_id length", "completions", {"prompt": "x", "request_id": "r" * 10000}, {}, 400, "request_id"),
    ("5,000-deep JSON in the prompt", "completions", b'{"prompt": ' + DEEP + b"}", {}, 400, "prompt"),
    ("5,000-deep JSON in a message", "chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + DEEP + b"}]}]}", {}, 400, None),
    ("5,000-deep JSON in an ignored extension field", "chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "metadata": ' + DEEP + b"}", {}, 400, None),
    ("5,000-deep JSON at the top", "completions", DEEP, {}, 400, None),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe\xfd"}', {}, 400, None),
    ("a lone surrogate", "completions", b'{"prompt": "\\ud800"}', {}, 400, None),
    ("logit_bias key \xb2 (isdigit, not int)", "completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}, {}, 400,
     "logit_bias"),
    ("logit_bias negative key", "completions", {"prompt": "x", "logit_bias": {"-1": 1}}, {}, 400, "logit_bias"),
    ("logit_bias 5,000-digit key", "completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, {}, 400,
     "logit_bias"),
    ("top_k = 1e30", "completions", b'{"prompt": "x", "top_k": 1e30}', {}, 400, "top_k"),
    ("top_k = 2^64-1", "completions", {"prompt": "x", "top_k": 2**64 - 1}, {}, 400, "top_k"),
    ("max_tokens = 2^64", "completions", b'{"prompt": "x", "max_tokens": 18446744073709551616}', {}, 400,
     "max_tokens"),
    ("num_speculative_tokens = 2^64 (past msgpack's ints)", "completions",
     b'{"prompt": "x", "num_speculative_tokens": 18446744073709551616}', {}, 400, "num_speculative_tokens"),
    ("logprob_token_ids without logprobs (nothing would carry them)", "completions",
     {"prompt": "x", "logprob_token_ids": [1]}, {}, 400, "logprob_token_ids"),
    ("chat logprob_token_ids without logprobs", "chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprob_token_ids": [1]}, {}, 400, "logprob_token_ids"),
    ("prompt_logprobs while streaming", "completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, {},
     400, "prompt_logprobs"),
    ("a 1.9 MB chat role (counted as the template renders it)", "chat/completions",
     {"messages": [{"role": "hello world " * 160000, "content": "x"}]}, {}, 400, "messages"),
    ("prompt token id -1", "completions", {"prompt": [5, -1]}, {}, 400, "prompt"),
    ("prompt token id 2^32", "completions", {"prompt": [[5, 2**32]]}, {}, 400, "prompt"),
    ("seed = -1", "completions", {"prompt": "x", "seed": -1}, {}, 400, "seed"),
    ("an empty body", "completions", b"", {}, 400, None),
    ("NaN temperature", "completions", b'{"prompt": "x", "temperature": NaN}', {}, 400, None),
    ("a 1,000-character prompt over the context", "completions", {"prompt": "a" * 1000}, {}, 400, "prompt"),
    ("a blind text/plain POST (no preflight from a web page)", "completions", {"prompt": "x"},
     {"content-type": "text/plain"}, 415, "Content-Type"),
    ("no Content-Type", "completions", {"prompt": "x"}, {"content-type": ""}, 415, "Content-Type"),
    ("DNS rebinding: a foreign Host on a loopback server", "completions", {"prompt": "x"},
     {"host": "evil.example:8000"}, 400, "Host"),
    ("a wrong key", "completions", {"prompt": "x"}, {"authorization": f"Bearer {KEY}x"}, 401, None),
    ("no key", "completions", {"prompt": "x"}, {"authorization": ""}, 401, None),
    ("a key differing in its first byte", "completions", {"prompt": "x"}, {"authorization": "Bearer X" + KEY[1:]},
     401, None),
]


def probe(url: str, endpoint: str, body, extra: dict) -> httpx.Response:
    headers = {k: v for k, v in {**AUTH, **extra}.items() if v}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/{endpoint}", content=content, headers=headers, timeout=60)


def raw_request(url: str, head: bytes, body_chunks=(), read_timeout: float = 30) -> int:
    """Send ``head`` then ``body_chunks``, then read the response's status (the body need not be complete: a
    refusal must come without it)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            sock.sendall(chunk)
        data = b""
        while b"\r\n" not in data:
            part = sock.recv(4096)
            if not part:
                break
            data += part
    return int(data.split(b" ", 2)[1])


def test_every_probe_is_a_4xx_health_answers_and_the_bystander_is_unchanged(server):
    alone = stream_text(server, BYSTANDER)
    watch = HealthWatch(server)
    during = {}
    bystander = threading.Thread(target=lambda: during.setdefault("text", stream_text(server, BYSTANDER)))
    bystander.start()
    try:
        failures = []
        for name, endpoint, body, extra, status, field in PROBES:
            r = probe(server, endpoint, body, extra)
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code != status or (field is not None and not (err.get("param") or "").startswith(field)):
                failures.append((name, r.status_code, r.text[:300]))
        assert not failures, failures

        # the probes that stalled everyone on main: a 5 MB body (refused from its Content-Length before a byte
        # of it is sent; sent chunked without a length, refused as soon as 2 MB + 64 KB of it came) and a
        # 1.9 MB text prompt (under the body cap, over the context: refused without tokenizing it)
        t0 = time.monotonic()
        five_mb = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: application/json\r\n").encode()
        assert raw_request(server, head + f"Content-Length: {len(five_mb)}\r\n\r\n".encode()) == 413
        chunks = [b"%x\r\n%s\r\n" % (65536, five_mb[i:i + 65536]) for i in range(0, 2 * 1024 * 1024 + 1, 65536)]
        assert raw_request(server, head + b"Transfer-Encoding: chunked\r\n\r\n", chunks) == 413
        r = probe(server, "completions", {"prompt": "hello world " * 160000}, {})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        t1 = time.monotonic()
        time.sleep(0.1)
        big = watch.between(t0, t1)
        bystander.join(120)
    finally:
        watch.close()
    assert during["text"] == alone  # greedy, batch-invariant: the same tokens beside every probe
    statuses = [s for _, _, s in watch.polls]
    assert statuses and all(s == 200 for s in statuses), set(statuses)
    worst = max(dt for _, dt, _ in watch.polls)
    print(f"/health: {len(watch.polls)} polls, median {statistics.median(dt for _, dt, _ in watch.polls) * 1e3:.1f} "
          f"ms, worst {worst * 1e3:.1f} ms; during the big bodies: {len(big)} polls, worst {max(big) * 1e3:.1f} ms")
    assert worst < 2.0, "a /health poll waited seconds: something ran on the event loop"
    assert big and statistics.median(big) < 0.1  # the bound the issue asks for (a shared CI box may hiccup once)
    assert stream_text(server, BYSTANDER) == alone  # healthy afterwards


def test_metrics_and_docs_need_the_key(server):
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(server + path).status_code == 401
        assert httpx.get(server + path, headers=AUTH).status_code == 200
    assert httpx.get(server + "/health").status_code == 200  # a load balancer's probe needs no key


def test_ids_a_client_chooses_never_collide(server):
    """On main, `0_R` sent while `R` ran with n=2 got R's token and R's client hung; a duplicate id was a 500.
    Now a client's id is only echoed back: each request gets exactly its own tokens."""
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    want_r = complete(server, {**body, "prompt": "Once upon a time"})["choices"][0]["text"]
    want_x = complete(server, {**body, "prompt": "zzz"})["choices"][0]["text"]
    assert want_r != want_x
    results = {}

    def send(key, req):
        results[key] = httpx.post(server + "/v1/completions", json=req, headers=AUTH, timeout=120)

    threads = [threading.Thread(target=send, args=("R", {**body, "prompt": "Once upon a time", "n": 2,
                                                         "request_id": "R"}))]
    threads[0].start()
    time.sleep(0.2)
    for key, rid in (("0_R", "0_R"), ("1_R", "1_R"), ("dup", "R"), ("R-0", "R-0")):
        threads.append(threading.Thread(target=send, args=(key, {**body, "prompt": "zzz", "request_id": rid})))
        threads[-1].start()
    for t in threads:
        t.join(120)
    assert {k: r.status_code for k, r in results.items()} == dict.fromkeys(("R", "0_R", "1_R", "dup", "R-0"), 200)
    r = results["R"].json()
    assert r["id"] == "R" and [c["text"] for c in r["choices"]] == [want_r, want_r]
    for key in ("0_R", "1_R", "dup", "R-0"):
        assert [c["text"] for c in results[key].json()["choices"]] == [want_x], key


def test_a_non_streaming_request_past_its_deadline_is_a_408_and_aborted():
    """The core is paused (SIGSTOP) so the request cannot finish whatever the machine's speed; the server
    answers 408 at its deadline and aborts the request in the core."""
    import signal

    from tests.serve.conftest import LiveServer

    srv = LiveServer({"serve": {"restart_on_failure": False, "limits": {"request_timeout_s": 1.0}}})
    try:
        pid = srv.engine.client.pid
        result = {}

        def send():
            result["r"] = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                                        "ignore_eos": True}, timeout=60)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 20
        while srv.engine.num_in_flight() == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pid, signal.SIGSTOP)
        try:
            t.join(30)
        finally:
            os.kill(pid, signal.SIGCONT)
        r = result["r"]
        assert r.status_code == 408 and "request_timeout_s" in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 20
        while srv.engine.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.engine.num_in_flight() == 0
    finally:
        srv.stop()


def test_no_cors_by_default(server):
    """A web page on another origin gets no CORS grant (its preflight is refused, no allow-origin header)."""
    pre = httpx.options(server + "/v1/completions", headers={"origin": "http://evil.example",
                                                             "access-control-request-method": "POST"})
    assert pre.status_code >= 400 and "access-control-allow-origin" not in pre.headers
    r = httpx.get(server + "/health", headers={"origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_origins_when_configured():
    """serve.cors_origins grants exactly those origins (the preflight needs no key; the request still does)."""
    from starlette.testclient import TestClient

    from specdec.entrypoints.engine_args import AsyncEngineArgs
    from specdec.serve.app import OpenAIServer
    from specdec.v1.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(AsyncEngineArgs(model="tiny-random-llama", max_model_len=256))  # never started
    app = OpenAIServer(engine, "tiny-random-llama", api_key=KEY, cors_origins=["http://app.example"]).build()
    client = TestClient(app, base_url="http://127.0.0.1")  # no lifespan: nothing reaches the engine here
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    ok = client.options("/v1/completions", headers={"origin": "http://app.example", **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = client.options("/v1/completions", headers={"origin": "http://evil.example", **ask})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert client.get("/v1/models", headers={"origin": "http://app.example"}).status_code == 401


def test_bad_words_tokenized_by_the_server_apply_as_in_the_library(server):
    """The server tokenizes bad_words once (in a worker thread) and hands the engine their ids alone: the
    output is the library's, which tokenizes them itself, and differs from the unconstrained one."""
    from specdec import LLM, SamplingParams

    plain = complete(server, {**BYSTANDER, "max_tokens": 16})["choices"][0]["text"]
    words = [c for c in plain if c.isascii() and c.isprintable() and not c.isspace()][:2]  # byte tokens it made
    assert words, plain
    got = complete(server, {**BYSTANDER, "max_tokens": 16, "bad_words": words})["choices"][0]["text"]
    llm = LLM("tiny-random-llama", max_num_seqs=1, max_model_len=256)
    want = llm.generate(BYSTANDER["prompt"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                            bad_words=words), use_tqdm=False)[0].outputs[0].text
    assert got == want and got != plain, (plain, words, got, want)
