"""experiments/bench/oracle.py: the hindsight schedule on hand-made cases (each answer worked out beside it), the
accepted lengths against the n-gram proposer's own lookup, and a run on the tiny model. The figures for
experiments/LOG.md come from SmolLM2 on a quiet machine, not from here."""

import json

import pytest

from experiments.bench.oracle import accepted_lengths, main, oracle_seconds


def test_the_bound_drafts_what_will_be_accepted_where_it_pays():
    # costs of a step drafting k = 0, 1, 2, 3 tokens; the output has N = 6 tokens, positions i = 1..5
    step = [1.0, 1.1, 1.2, 1.3]
    # a(1) = 3: one step of k = 3 emits 4 tokens (i = 1 -> 5), then a(5) = 0: one plain step -> 2.3 s, 2 steps
    secs, ks = oracle_seconds([3, 0, 0, 0, 0], step)
    assert secs == pytest.approx(2.3) and ks == [3, 0]
    # nothing accepted anywhere: five plain steps
    assert oracle_seconds([0, 0, 0, 0, 0], step) == (pytest.approx(5.0), [0, 0, 0, 0, 0])
    # a(i) beyond the costs' K is capped at K = 3: N = 5, one step of k = 3 emits the last 4 tokens
    assert oracle_seconds([9, 9, 9, 9], step) == (pytest.approx(1.3), [3])


def test_a_draft_that_costs_more_than_it_emits_is_not_taken():
    # a k = 1 step costs 2.5 plain steps and emits 2 tokens: plain steps are cheaper
    assert oracle_seconds([1, 1, 1], [1.0, 2.5]) == (pytest.approx(3.0), [0, 0, 0])


def test_the_schedule_is_the_shortest_path_not_the_greedy_one():
    # a(1) = 1 and a(2) = 3: drafting 1 at i = 1 lands on i = 3 (a = 0), where plain steps follow: 1.1 + 3 = 4.1;
    # a plain step to i = 2 then k = 3 reaches the end: 1.0 + 1.3 = 2.3
    secs, ks = oracle_seconds([1, 3, 0, 0, 0], [1.0, 1.1, 1.2, 1.3])
    assert secs == pytest.approx(2.3) and ks == [0, 3]


def test_accepted_lengths_follow_the_ngram_lookup():
    from proposers.ngram import ngram_lookup
    import numpy as np

    prompt = [5, 6, 7, 8, 9, 5, 6]
    out = [7, 8, 1, 5, 6, 7]
    acc = accepted_lengths(prompt, out, k=4, min_n=1, max_n=3)
    assert len(acc) == len(out) - 1
    for i, a in enumerate(acc, 1):
        d = ngram_lookup(np.array(prompt + out[:i]), 4, 1, 3).tolist()
        want = next((j for j, (x, y) in enumerate(zip(d, out[i:])) if x != y), min(len(d), len(out) - i))
        assert a == want, (i, d)
    # i = 1: [.., 5, 6] + [7] ends in the 3-gram 5 6 7 seen at the start, whose continuation 8 9 5 6 meets
    # out[1:] = 8 1 5 ..: one token
    assert acc[0] == 1


def test_a_run_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "o.json"
    res = main(["--model", "tiny-random-llama", "--categories", "summarization,rag", "--per-category", "1",
                "--max-tokens", "12", "--k", "4", "--threads", "1", "--out", str(out)])
    assert "| rag |" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["k"] == 4 and len(saved["costs_ms"]["rag"]) == 5  # k = 0 .. 4
    assert set(res["per_category"]) == {"summarization", "rag", "overall"}
    assert all(s["greedy_equal"] for s in res["per_category"].values())
    for r in res["prompts"]:  # the bound never takes longer than plain decoding's own schedule
        assert r["prefill_s"] <= r["oracle_s"] <= max(r["plain_s"], r["prefill_s"]) + 1e-9
