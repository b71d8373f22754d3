"""Offline replay (specdec/experiment/replay.py) against live runs on the tiny model.

Greedy exactness: for every drafter kind (n-gram, draft model, layer-skip, EAGLE chain and tree) the replay
of a trace recorded once by a plain run gives the live run's acceptance counts, question by question, and so
its tau, acceptance rate and acceptance per position, exactly; the replay of the live run's own trace too.
Sampling: the expected acceptance sum min(p, q) replayed from the recorded top-N p matches the live rate.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.experiment.replay import greedy_path, replay
from specdec.experiment.run import run
from specdec.experiment.summary import read_summary

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
# 4 prompts x 48 greedy tokens: the tiny model's outputs mix repeats (long accepted runs) and new tokens
BASE = ["model=tiny", "turns=1", "measure_baseline=false", "warmup=false", "sampling.max_tokens=48",
        "dataset.categories=[writing,qa,math_reasoning,summarization]"]
RECORD = ["trace=true", "trace_features=true", "trace_features_dtype=float32"]
HEAD = "HEAD"  # replaced by the pass-through head's directory
DRAFTERS = {
    "ngram": ["proposer=ngram", "proposer.num_speculative_tokens=4"],
    # the target itself as its draft: every draft accepted, so every step ends in a bonus token (back-fill)
    "draft_model": ["proposer=draft_model", "proposer.model=tiny-random-llama", "proposer.num_speculative_tokens=4"],
    "layer_skip": ["proposer=layer_skip", "proposer.num_layers=2", "proposer.num_speculative_tokens=4"],
    "eagle": ["proposer=eagle", f"proposer.model={HEAD}", "~proposer.options", "proposer.num_speculative_tokens=4"],
    "eagle_tree": ["proposer=eagle", f"proposer.model={HEAD}", "~proposer.options", "scorer=tree",
                   "proposer.num_speculative_tokens=3", "scorer.tree_topk=3", "scorer.tree_budget=6"],
}
LOADS_TARGET = {"ngram": False, "draft_model": False, "layer_skip": True, "eagle": True, "eagle_tree": True}


def cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    """An EAGLE-1 head that passes the target's feature through (fc picks it, the layer adds nothing), so it
    drafts the target's own last prediction again: right on the tiny model's repeats, wrong elsewhere. A
    random head is never right, which would make its exactness trivial."""
    from specdec.engine.tiny import tiny_config
    from specdec.heads.eagle import random_head, write_eagle1

    head = random_head(tiny_config(), "eagle", 0)
    D = head.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, D:] = torch.eye(D)
        head.self_attn.o_proj.weight.zero_()
        head.mlp.down_proj.weight.zero_()
    return write_eagle1(tmp_path_factory.mktemp("head"), head.cfg, head.state_dict(), dtype=torch.float32)


@pytest.fixture(scope="module")
def plain_trace(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain")
    run(cfg("config", BASE + RECORD + [f"output_dir={out}"]))
    return out


def _counts(summary) -> dict[str, list[int]]:
    return {r.question_id: r.acceptance_counts for r in summary.requests}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_replay_equals_the_live_run(name, plain_trace, head_dir, tmp_path):
    drafter = [o.replace(HEAD, str(head_dir)) for o in DRAFTERS[name]]
    live = run(cfg("config", BASE + drafter + RECORD + [f"output_dir={tmp_path / 'live'}"]))
    counts = _counts(live)
    steps = sum(c[0] for c in counts.values())
    accepted = sum(sum(c[1:]) for c in counts.values())
    assert steps >= 40 and accepted > 0, counts  # a test of something: drafts are accepted, and steps are many
    if name != "draft_model":
        assert any(c[1] < c[0] for c in counts.values()), counts  # ... and some are rejected
    for trace in (plain_trace, tmp_path / "live"):  # recorded by plain decoding, and by the live run itself
        rep = replay(cfg("replay", drafter + [f"run_dir={trace}", f"output_dir={tmp_path / 'rep'}"]))
        assert _counts(rep) == counts
        assert rep.mean_acceptance_length == live.mean_acceptance_length
        assert rep.acceptance_rate == live.acceptance_rate
        assert rep.acceptance_per_position == live.acceptance_per_position
        assert rep.predicted_tau == live.predicted_tau and rep.alpha_per_position == live.alpha_per_position
        assert rep.replay["steps_past_recording"] == 0 and rep.replay["mode"] == "greedy"
        assert rep.replay["target_loaded"] == LOADS_TARGET[name]  # only what the proposer itself needs
        assert rep.tokens_per_s is None and rep.speedup is None  # a replay has no speed
        assert read_summary(tmp_path / "rep" / "summary.json").mean_acceptance_length == live.mean_acceptance_length


def test_greedy_path_chain_and_tree():
    full = [9, 9, 1, 2, 3, 4]  # positions 0..5; the pending token is at L-1 = 1, so drafts predict 1, 2, 3, 4
    assert greedy_path([1, 2, 7, 4], [-1, 0, 1, 2], full, 2) == ([0, 1], 0)  # chain: the matching prefix
    assert greedy_path([5, 2], [-1, 0], full, 2) == ([], 0)  # first draft wrong: nothing after it counts
    # tree: two matching branches, the deeper one wins; equal depth -> the lower node index
    assert greedy_path([1, 1, 2, 2, 3], [-1, -1, 0, 1, 3], full, 2) == ([1, 3, 4], 0)
    assert greedy_path([1, 1, 2, 2], [-1, -1, 0, 1], full, 2) == ([0, 2], 0)
    # a chain that matches to the end of the recording: the draft past it counts as rejected and is flagged
    assert greedy_path([3, 4, 5], [-1, 0, 1], full, 4) == ([0, 1], 1)


def test_replay_refuses_what_it_cannot_replay(plain_trace, tmp_path):
    with pytest.raises(ValueError, match="no drafter"):
        replay(cfg("replay", [f"run_dir={plain_trace}", f"output_dir={tmp_path}"]))
    bare = tmp_path / "bare"
    run(cfg("config", BASE + ["trace=true", "dataset.categories=[qa]", f"output_dir={bare}"]))
    with pytest.raises(ValueError, match="trace_features=true"):  # EAGLE needs the recorded features
        replay(cfg("replay", ["proposer=eagle", "proposer.model=tiny-random-llama", "~proposer.options",
                              f"run_dir={bare}", f"output_dir={tmp_path}"]))
    with pytest.raises(FileNotFoundError, match="trace=true"):
        replay(cfg("replay", ["proposer=ngram", f"run_dir={tmp_path}", f"output_dir={tmp_path}"]))


def test_cli_sweep_feeds_the_report(plain_trace, tmp_path):
    """`python -m specdec.replay <run dir> -m ...` is a Hydra multirun (the default joblib launcher, in worker
    processes); specdec.experiment.report reads it."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "specdec.replay", str(plain_trace), "-m", "proposer=ngram",
           "proposer.num_speculative_tokens=1,4", f"hydra.sweep.dir={sweep}"]  # joblib: 2 worker processes
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = sorted(sweep.glob("*/summary.json"))
    assert len(paths) == 2 and res.stdout.strip().splitlines()[-1].endswith("summary.json")
    taus = [read_summary(p).mean_acceptance_length for p in paths]
    assert taus[0] < taus[1]  # k=1 caps tau at 2; the tiny model's repeats reward k=4
    res = subprocess.run([sys.executable, "-m", "specdec.report", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "proposer.num_speculative_tokens" in (sweep / "report" / "report.csv").read_text().splitlines()[0]


def test_expected_acceptance_at_t1_matches_the_live_rate(tmp_path):
    """T = 1, k = 1, a draft model with other random weights than the target (its q and the target's p
    overlap partly). The live run records its own trace with the target's full distribution (top-N = the
    vocabulary, so the tail bound is 0); the replay's mean alpha_t = sum_x min(p_t(x), q_t(x)) over the
    recorded positions must equal the live accepted / proposed rate within statistical error.

    Power: each live step is one Bernoulli(alpha_t) trial given its prefix (Leviathan et al. 2023), so the
    live rate minus the mean alpha over its steps has standard error sqrt(sum alpha_t (1 - alpha_t)) / n
    <= 0.5 / sqrt(n). With n ~ 1000 steps that is <= 0.016: the 4-sigma tolerance fails a correct replay with
    probability < 1e-4 and detects any bias above ~0.08 (e.g. forgetting min(), using raw instead of
    processed p, or an off-by-one position, each of which moves alpha by far more here) with probability
    > 0.97 (bias - 4 SE > 2 SE)."""
    drafter = ["proposer=draft_model", "proposer.model=tiny-random-llama", "+proposer.options={seed:1}",
               "proposer.num_speculative_tokens=1"]
    t1 = ["model=tiny", "turns=1", "measure_baseline=false", "warmup=false", "sampling.max_tokens=64",
          "sampling.temperature=1.0", "dataset.per_category=2"]
    live = run(cfg("config", t1 + drafter + ["trace=true", "trace_top_n=512", f"output_dir={tmp_path / 'live'}"]))
    steps = sum(r.acceptance_counts[0] for r in live.requests)
    assert steps > 800
    rep = replay(cfg("replay", drafter + [f"run_dir={tmp_path / 'live'}", f"output_dir={tmp_path / 'rep'}"]))
    info = rep.replay
    assert info["mode"] == "expected" and info["positions"] > steps
    assert info["alpha_upper"] - info["alpha_lower"] < 1e-4  # full distribution recorded: no tail
    assert 0.1 < live.acceptance_rate < 0.9  # partial overlap: a test of the formula, not of 0 or 1
    se = 0.5 / steps ** 0.5
    assert abs(info["alpha_lower"] - live.acceptance_rate) < 4 * se, (info["alpha_lower"], live.acceptance_rate, se)
    assert rep.acceptance_rate == pytest.approx(info["alpha_lower"], rel=0.05)  # k=1: per-position = alpha


def test_expected_acceptance_tail_bound(tmp_path):
    """With top-N < V the truncated tail bounds alpha: lower <= upper, and the gap is at most the tail mass."""
    drafter = ["proposer=ngram", "proposer.num_speculative_tokens=2"]
    t1 = ["model=tiny", "turns=1", "measure_baseline=false", "warmup=false", "sampling.max_tokens=24",
          "sampling.temperature=0.8", "dataset.categories=[writing,qa]"]
    run(cfg("config", t1 + ["trace=true", "trace_top_n=4", f"output_dir={tmp_path / 'live'}"]))
    rep = replay(cfg("replay", drafter + [f"run_dir={tmp_path / 'live'}", f"output_dir={tmp_path / 'rep'}"]))
    info = rep.replay
    assert 0.0 <= info["alpha_lower"] <= info["alpha_upper"] <= 1.0
    assert info["tau_lower"] <= info["tau_upper"] <= 3.0
    assert len(rep.acceptance_per_position) == 2


SMOL = ["model=smollm2", "turns=1", "measure_baseline=false", "warmup=false", "sampling.max_tokens=48",
        "dataset.categories=[writing,coding]"]
SMOL_DRAFTERS = {
    "ngram": ["proposer=ngram", "proposer.num_speculative_tokens=4"],
    "draft_model": ["proposer=draft_model", "proposer.model=smollm2-135m-instruct",
                    "proposer.num_speculative_tokens=3"],
    "layer_skip": ["proposer=layer_skip", "proposer.num_layers=12", "proposer.num_speculative_tokens=3"],
    "eagle": ["proposer=eagle", "proposer.num_speculative_tokens=3"],  # the shipped head, its 2048-token vocab
    "eagle_tree": ["+experiment=eagle1", "dataset=spec_bench", "dataset.categories=[writing,coding]"],  # 3x3x6
}


@pytest.mark.slow
def test_smollm2_greedy_replay_equals_the_live_run(tmp_path):
    """The same exactness on the real default model (2 prompts x 48 tokens, every drafter kind)."""
    trace = tmp_path / "trace"
    run(cfg("config", SMOL + RECORD + [f"output_dir={trace}"]))
    for name, drafter in SMOL_DRAFTERS.items():
        live = run(cfg("config", SMOL + drafter + [f"output_dir={tmp_path / name}"]))
        rep = replay(cfg("replay", drafter + [f"run_dir={trace}", f"output_dir={tmp_path / (name + '_rep')}"]))
        assert _counts(rep) == _counts(live), name
        assert rep.mean_acceptance_length == live.mean_acceptance_length > 1.0, name
        assert rep.replay["steps_past_recording"] == 0, name


@pytest.mark.parametrize("forward_s", [
    {"1": 0.010, "2": 0.0105, "4": 0.012, "8": 0.016, "16": 0.030},  # rows cheap: k > 0 wherever a match drafts
    {"1": 0.010, "2": 0.016, "4": 0.022, "8": 0.034, "16": 0.060},  # rows dear: steps at 0 (plain, shadow drafts)
], ids=["cheap_rows", "dear_rows"])
def test_a_goodput_policy_replays_its_live_choices(tmp_path, forward_s):
    """Live goodput on a fixed cost table (refresh_cost=false) and its replay from the trace alone: the same
    choices step by step (histogram) and the same acceptance, so the replayed tau is the live tau. Where rows are
    dear the policy chooses 0 on some steps: the live worker runs them plainly and keeps its estimate fresh through
    the n-gram's shadow drafts, and so must the replay."""
    import json

    table = tmp_path / "cost.json"  # a one-token forward of 10 ms; each more row costs more past a few
    table.write_text(json.dumps({"forward_s": forward_s, "per_token_s": 0.0002, "overhead_s": 0.001}))
    drafter = DRAFTERS["ngram"] + ["proposer.speculation_policy=goodput", f"++proposer.policy_options.cost_table={table}",
                                   "++proposer.policy_options.refresh_cost=false", "++proposer.policy_options.probe_every=2"]
    live = run(cfg("config", BASE + drafter + ["trace=true", f"output_dir={tmp_path / 'live'}"]))
    assert len(live.chosen_k_histogram) >= 2, live.chosen_k_histogram  # the policy varied k: a test of something
    zeros = live.chosen_k_histogram.get("0", 0)  # cheap rows: at 0 only where the n-gram has no match (class 0)
    assert (zeros > 0) if forward_s["2"] > 0.012 else zeros < live.chosen_k_histogram["4"], live.chosen_k_histogram
    rep = replay(cfg("replay", drafter + [f"run_dir={tmp_path / 'live'}", f"output_dir={tmp_path / 'rep'}"]))
    assert rep.chosen_k_histogram == live.chosen_k_histogram and rep.speculation_policy == "goodput"
    assert _counts(rep) == _counts(live) and rep.mean_acceptance_length == live.mean_acceptance_length
    assert rep.replay["modelled_tokens_per_s"] > 0
    # without a table file, the replay decides from the one the traced run wrote into meta.json
    table.unlink()
    rep2 = replay(cfg("replay", drafter + [f"run_dir={tmp_path / 'live'}", f"output_dir={tmp_path / 'rep2'}"]))
    assert rep2.chosen_k_histogram == live.chosen_k_histogram


def test_the_cli_refuses_what_a_replay_would_ignore(plain_trace, tmp_path):
    """The model, context, seed, prompts and sampling come from the trace: overrides of them were recorded in the
    replay's summary and unused; a second run directory was dropped without a word (Hydra kept the last)."""
    for extra, words in ((["sampling.temperature=0.8"], "sampling.temperature=0.8: a replay takes"),
                         (["max_model_len=4096"], "max_model_len=4096: a replay takes"),
                         ([str(plain_trace)], "one run directory per replay; got 2")):
        res = subprocess.run([sys.executable, "-m", "specdec.replay", str(plain_trace), "proposer=ngram", *extra,
                              f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode != 0 and words in res.stderr, res.stderr[-2000:]


def test_a_damaged_trace_is_named_with_the_way_out(plain_trace, tmp_path):
    import json
    import shutil

    from specdec.experiment.trace import load_trace

    for damage, words in ((lambda d: (d / "meta.json").write_text("{"), "meta.json is unreadable"),
                          (lambda d: (d / "steps.parquet").write_bytes(b"PAR1 cut"), "steps.parquet is unreadable"),
                          (lambda d: (d / "steps.parquet").unlink(), "steps.parquet is missing"),
                          (lambda d: (d / "meta.json").write_text(json.dumps(
                              {k: v for k, v in json.loads((d / "meta.json").read_text()).items() if k != "model"})),
                           r"lacks \['model'\]")):
        d = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        shutil.copytree(plain_trace / "trace", d)
        damage(d)
        with pytest.raises(ValueError, match=rf"{words}.*re-record it with `python -m specdec.run \.\.\. trace=true`"):
            load_trace(d)


def test_a_trace_that_reads_but_lies_is_refused_naming_what(plain_trace, tmp_path):
    """Edited tables that pyarrow still reads: a cut target_ids, ids outside the vocabulary, a request twice, steps of
    an unknown request. Each would replay to wrong figures; each is named."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from specdec.experiment.trace import load_trace

    def edit(name, fn):
        def damage(d):
            t = pq.read_table(d / f"{name}.parquet")
            pq.write_table(fn(t), d / f"{name}.parquet")
        return damage

    def set_col(t, col, fn):
        return t.set_column(t.column_names.index(col), col, pa.array([fn(v) for v in t.column(col).to_pylist()],
                                                                    type=t.schema.field(col).type))

    for damage, words in (
            (edit("requests", lambda t: set_col(t, "target_ids", lambda v: v[:3])), "do not begin with its output_ids"),
            (edit("requests", lambda t: set_col(t, "prompt_ids", lambda v: v[:-1] + [10**6])), "outside the vocabulary"),
            (edit("requests", lambda t: pa.concat_tables([t, t.slice(0, 1)])), "appears twice"),
            (edit("steps", lambda t: set_col(t, "request_id", lambda v: "nobody")), "that requests.parquet lacks")):
        d = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        shutil.copytree(plain_trace / "trace", d)
        damage(d)
        with pytest.raises(ValueError, match=rf"does not hold together: .*{words}.*re-record it"):
            load_trace(d)
    load_trace(plain_trace)  # the recorded one holds together
