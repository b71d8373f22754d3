"""Per-request speculative metrics (``return_spec_decode_metrics``) and the policy's chosen k in /metrics (#44),
against a live server whose draft model is its target (tiny-random-llama drafting for itself, static policy)."""

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import draft_server, plain_server  # noqa: F401 - fixtures

CHOSEN = "specdec_spec_decode_num_chosen_tokens_per_request"
BODY = {"model": "tiny-random-llama", "prompt": "the cat sat on the", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def _chosen(url: str) -> dict[str, float]:
    """The chosen-k histogram's samples: bucket upper bound ("1.0", "+Inf") -> count, plus "count" and "sum"."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name == CHOSEN:
            for s in fam.samples:
                key = s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
                out[key] = s.value
    return out


def test_chosen_k_histogram_counts_every_decode_step(draft_server):
    before = _chosen(draft_server.url)
    r = httpx.post(draft_server.url + "/v1/completions", timeout=120,
                   json={**BODY, "num_speculative_tokens": 2, "return_spec_decode_metrics": True})
    assert r.status_code == 200, r.text
    m = r.json()["spec_decode_metrics"]
    after = _chosen(draft_server.url)
    steps = after["count"] - before.get("count", 0)
    # one observation per decode step of the only request, each k <= its cap of 2 (static: the cap, less near the end)
    assert steps == m["num_steps"] > 0
    assert after["2.0"] - before.get("2.0", 0) == steps
    assert after["1.0"] - before.get("1.0", 0) < steps  # the cap, 2, is chosen while there is room
    assert 0 < after["sum"] - before.get("sum", 0) <= 2 * steps
    # the response's own histogram and draft total say the same for this request
    hist = m["chosen_k_histogram"]
    assert sum(hist) == steps and len(hist) <= 3 and hist[2] > 0
    assert m["mean_chosen_k"] == (after["sum"] - before.get("sum", 0)) / steps
    assert m["num_accepted_tokens"] <= m["num_draft_tokens"] <= m["mean_chosen_k"] * steps
    assert m["acceptance_rate"] == m["num_accepted_tokens"] / m["num_draft_tokens"]


def test_response_carries_metrics_only_when_asked(draft_server):
    url = draft_server.url
    plain = httpx.post(url + "/v1/completions", json=BODY, timeout=120).json()
    assert "spec_decode_metrics" not in plain
    asked = httpx.post(url + "/v1/completions", json={**BODY, "return_spec_decode_metrics": True}, timeout=120).json()
    m = asked["spec_decode_metrics"]
    counts = m["acceptance_counts"]
    # prefill emits the first token; each decode step emits 1 + its accepted drafts, the last one cut at max_tokens
    assert m["num_emitted_tokens"] == m["num_steps"] + m["num_accepted_tokens"]
    assert 0 <= m["num_emitted_tokens"] - (asked["usage"]["completion_tokens"] - 1) < len(counts)
    assert m["num_steps"] == counts[0] and m["num_accepted_tokens"] == sum(counts[1:])
    assert m["acceptance_per_position"] == [c / counts[0] for c in counts[1:]]
    assert m["mean_acceptance_length"] == sum(counts) / counts[0]
    assert asked["choices"][0]["text"] == plain["choices"][0]["text"]
    assert sum(m["chosen_k_histogram"]) == m["num_steps"] and m["num_draft_tokens"] >= m["num_accepted_tokens"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-random-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True, "return_spec_decode_metrics": True}).json()
    assert 0 < chat["spec_decode_metrics"]["num_steps"] < chat["usage"]["completion_tokens"]


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_streaming_last_chunk(draft_server):
    url = draft_server.url
    for extra in ({}, {"stream_options": {"include_usage": True}}):
        chunks = _chunks(url, "/v1/completions", {**BODY, **extra, "return_spec_decode_metrics": True})
        assert all("spec_decode_metrics" not in c for c in chunks[:-1])
        last = chunks[-1]
        assert last["choices"] == [] and last["spec_decode_metrics"]["num_steps"] > 0
        assert ("usage" in last) == bool(extra)
    chunks = _chunks(url, "/v1/chat/completions", {"model": "tiny-random-llama", "max_tokens": 8, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "hi"}],
                                                   "return_spec_decode_metrics": True})
    assert chunks[-1]["spec_decode_metrics"]["num_steps"] > 0
    assert all("spec_decode_metrics" not in c for c in _chunks(url, "/v1/completions", BODY))


def test_bad_value_is_a_400_naming_the_field(draft_server):
    for bad in ("yes", 1, None, {"a": 1}):
        r = httpx.post(draft_server.url + "/v1/completions", json={**BODY, "return_spec_decode_metrics": bad})
        assert r.status_code == 400, (bad, r.text)
        assert "return_spec_decode_metrics" in r.json()["error"]["message"]
    r = httpx.post(draft_server.url + "/v1/completions", json={**BODY, "return_spec_metrics": True})
    assert r.status_code == 400 and "return_spec_metrics" in r.json()["error"]["message"]


def test_plain_server_reports_zeros(plain_server):
    r = httpx.post(plain_server.url + "/v1/completions", json={**BODY, "return_spec_decode_metrics": True}, timeout=120)
    m = r.json()["spec_decode_metrics"]
    # plain decoding: every decode step emits its own token only (tau 1.0 = plain, datamodel/metrics.py)
    assert m["num_steps"] == r.json()["usage"]["completion_tokens"] - 1 and m["num_accepted_tokens"] == 0
    assert m["mean_acceptance_length"] == 1.0 and m["acceptance_per_position"] == []
    assert m["num_draft_tokens"] == 0 and m["acceptance_rate"] is None
    assert m["chosen_k_histogram"] == [m["num_steps"]] and m["mean_chosen_k"] == 0  # every step at k = 0
    assert _chosen(plain_server.url).get("count", 0) == 0  # a plain worker chooses no k


def test_openai_client_extra_body(draft_server):
    from openai import OpenAI

    client = OpenAI(base_url=draft_server.url + "/v1", api_key="unused")
    r = client.completions.create(model="tiny-random-llama", prompt="the cat", max_tokens=6, temperature=0,
                                  extra_body={"return_spec_decode_metrics": True, "num_speculative_tokens": 1})
    m = r.model_extra["spec_decode_metrics"]
    # k capped at 1: no step accepts a second draft (counts keep the engine's k + 1 positions)
    assert m["num_steps"] > 0 and not any(m["acceptance_counts"][2:])


def test_histogram_reports_the_policys_choice_not_the_cap():
    from tests.serve.conftest import DRAFT, LiveServer

    # vLLM's batch-size schedule: a batch of up to 4 drafts 1 token, though the engine's k is 3
    srv = LiveServer({"proposer": {**DRAFT["proposer"], "speculation_policy": "batch_size",
                                   "policy_options": {"schedule": [[4, 1]]}}})
    try:
        r = httpx.post(srv.url + "/v1/completions", json={**BODY, "return_spec_decode_metrics": True}, timeout=120)
        m = r.json()["spec_decode_metrics"]
        h = _chosen(srv.url)
        assert h["count"] == m["num_steps"] > 0 and h["sum"] == h["count"] and h["0.0"] == 0
        assert not any(m["acceptance_counts"][2:])
    finally:
        srv.stop()
