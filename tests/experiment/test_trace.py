"""Token traces (specdec/experiment/trace.py): what `specdec.experiment.run ... trace=true` writes, and that it says what happened."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.experiment.run import run
from specdec.experiment.trace import load_trace

CONF = str(Path(__file__).resolve().parents[2] / "conf")
BASE = ["model=tiny", "turns=1", "measure_baseline=false", "warmup=false", "sampling.max_tokens=20",
        "dataset.categories=[writing,qa]", "trace=true"]


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    summary = run(cfg(BASE + ["trace_features=true", f"output_dir={out}"]))
    return summary, load_trace(out)


@pytest.fixture(scope="module")
def ngram(tmp_path_factory):
    out = tmp_path_factory.mktemp("ngram")
    summary = run(cfg(BASE + ["proposer=ngram", "proposer.num_speculative_tokens=4", f"output_dir={out}"]))
    return summary, load_trace(out)


def test_requests_table(plain):
    summary, trace = plain
    reqs = trace.request_rows()
    assert [(r["question_id"], r["category"]) for r in reqs] == [(q.question_id, q.category) for q in summary.requests]
    for r in reqs:
        assert len(r["output_ids"]) == 20 and r["finish_reason"] == "length" and r["temperature"] == 0.0
        # the target's greedy tokens past the stop (trace_lookahead=16), for a replayed drafter's last step
        assert r["target_ids"][:20] == r["output_ids"] and len(r["target_ids"]) == 20 + 16
    assert trace.meta["model"] == "tiny-random-llama" and trace.meta["tail_mismatches"] == 0
    assert trace.meta["feature_layers"] == [] and trace.meta["features_dtype"] == "float16"


def test_plain_steps_and_features_line_up_with_the_target(plain):
    from specdec.engine import ForwardBatch
    from specdec.engine.loader import load_engine

    _, trace = plain
    steps = trace.steps.to_pylist()
    engine = load_engine("tiny-random-llama", num_slots=1, max_model_len=4096)
    for r in trace.request_rows():
        mine = [s for s in steps if s["request_id"] == r["request_id"]]
        P, out = len(r["prompt_ids"]), r["output_ids"]
        assert mine[0]["kind"] == "prefill" and mine[0]["position"] == P - 1
        assert [s["position"] for s in mine] == list(range(P - 1, P - 1 + len(out)))  # one token per plain step
        assert [t for s in mine for t in s["emitted"]] == out
        assert all(s["target_ids"] == s["emitted"] for s in mine)  # greedy: the argmax is what was emitted
        # the feature of position j is the target's hidden state at token j (last layer after the norm)
        feats = trace.features_of(r["request_id"])  # [P + len(out) - 1, F] every token but the last pending one
        ids = (r["prompt_ids"] + out)[:-1]
        assert feats.shape == (len(ids), engine.hidden_size) and feats.dtype == torch.float16
        slot = engine.allocate_slot()
        ref = engine.forward(ForwardBatch(token_ids=torch.tensor(ids), slots=[slot], query_lens=[len(ids)],
                                          logits_indices=torch.tensor([len(ids) - 1]), hidden_layers=())).features
        engine.free_slot(slot)
        torch.testing.assert_close(feats.float(), ref.half().float(), atol=1e-3, rtol=1e-3)


def test_speculative_steps(ngram):
    summary, trace = ngram
    steps = trace.steps.to_pylist()
    by_req: dict[str, list[int]] = {}
    for r in trace.request_rows():
        counts = [0] * 5
        mine = [s for s in steps if s["request_id"] == r["request_id"]]
        assert mine[0]["kind"] == "prefill" and all(s["kind"] == "spec" for s in mine[1:])
        assert mine[0]["chosen"] is None
        for s in mine[1:]:
            a, n = s["accepted"], len(s["draft_ids"])
            assert len(s["target_ids"]) == n + 1 and s["draft_parents"] == list(range(-1, n - 1))  # a chain
            assert s["path"] == list(range(a))
            # accepted drafts are the target's argmax; the final token is its argmax after them
            assert s["draft_ids"][:a] == s["target_ids"][:a] and s["final_token"] == s["target_ids"][a]
            assert a == n or s["draft_ids"][a] != s["target_ids"][a]
            assert s["emitted"] == s["draft_ids"][:a] + [s["final_token"]] and s["bonus"] == (a == n > 0)
            assert s["chosen"] == 4 and n <= s["chosen"]  # the static policy's k, the most a proposal holds
            counts[0] += 1
            for i in range(a):
                counts[i + 1] += 1
        assert counts == r["acceptance_counts"]  # the steps add up to the run's counters
        worker = [t for s in mine for t in s["emitted"]]
        assert worker[: len(r["output_ids"])] == r["output_ids"] and r["target_ids"][: len(worker)] == worker
        by_req[r["question_id"]] = counts
    assert by_req == {q.question_id: q.acceptance_counts for q in summary.requests}


def test_sampled_trace_records_top_n(tmp_path):
    run(cfg(BASE + ["proposer=ngram", "proposer.num_speculative_tokens=2", "sampling.temperature=0.7",
                    "trace_top_n=8", f"output_dir={tmp_path}"]))
    trace = load_trace(tmp_path)
    steps = trace.steps.to_pylist()
    for r in trace.request_rows():
        pos, ids, probs = trace.topn_of(r["request_id"])
        P, n = len(r["prompt_ids"]), len(r["target_ids"])
        assert list(pos) == list(range(P - 1, P + n - 1))  # every committed position: the prefill's and each step's
        assert ids.shape == probs.shape == (len(pos), 8)
        assert bool((probs[:, :-1] >= probs[:, 1:]).all()) and float(probs.sum(1).max()) <= 1 + 1e-5
        for s in (s for s in steps if s["request_id"] == r["request_id"] and s["draft_ids"]):
            assert len(s["draft_target_probs"]) == len(s["draft_ids"])
            assert all(0.0 <= p <= 1.0 for p in s["draft_target_probs"])


def test_tables_read_with_pandas(plain):
    pd = pytest.importorskip("pandas")
    _, trace = plain
    df = pd.read_parquet(trace.path / "steps.parquet")
    assert {"request_id", "position", "draft_ids", "target_ids", "accepted", "emitted", "bonus"} <= set(df.columns)


def test_errors_name_the_way_out(tmp_path):
    with pytest.raises(ValueError, match="proposer=none"):  # a speculative run's forwards fix the layers
        run(cfg(BASE + ["proposer=ngram", "trace_features=true", "trace_layers=[1]", f"output_dir={tmp_path}"]))
    with pytest.raises(FileNotFoundError, match="trace=true"):
        load_trace(tmp_path)


def test_a_policys_choices_reach_the_trace_and_the_summary(tmp_path):
    summary = run(cfg(BASE + ["proposer=ngram", "proposer.num_speculative_tokens=4", "proposer.speculation_policy=goodput",
                              f"output_dir={tmp_path}"]))
    rows = load_trace(tmp_path).steps.to_pylist()
    steps = [s for s in rows if s["kind"] == "spec"]
    assert all(0 <= s["chosen"] <= 4 and len(s["draft_ids"]) <= s["chosen"] for s in steps)
    hist = {}
    # plain-path steps (every row chose 0: kind "decode", chosen 0) count in the summary's histogram too; whether the
    # policy takes any depends on the measured step times
    for s in steps + [s for s in rows if s["kind"] == "decode"]:
        hist[str(s["chosen"])] = hist.get(str(s["chosen"]), 0) + 1
    assert summary.speculation_policy == "goodput" and summary.chosen_k_histogram == hist
