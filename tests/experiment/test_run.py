"""The Hydra entry point: every experiment composes, debug mode runs end to end, typos fail clearly."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.experiment.run import parse_config, run
from specdec.experiment.summary import read_summary

CONF = str(Path(__file__).resolve().parents[2] / "conf")
EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))
THEORY_FIELDS = ("predicted_tau", "verify_cost", "draft_cost", "predicted_speedup", "efficiency")


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_in_debug_mode(experiment, tmp_path, capsys):
    # the flagship's goodput policy chooses from timed costs: with the random debug head, whose drafts the target
    # rejects, it may stop drafting in a category on one run and not the next; the static policy drafts every step
    pin = ["proposer.speculation_policy=static"] if experiment == "eagle" else []
    cfg = compose_cfg([f"+experiment={experiment}", "debug=true", f"output_dir={tmp_path}",
                       "dataset.categories=[writing,qa]", *pin])
    summary = run(cfg)
    path = tmp_path / "summary.json"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(path)  # the path is printed last
    back = read_summary(path)
    assert back.num_prompts == summary.num_prompts == 2
    assert back.num_generated_tokens == summary.num_generated_tokens > 0
    assert set(back.per_category) == {"writing", "qa"}
    assert back.tokens_per_s > 0 and back.mean_acceptance_length >= 1.0
    assert set(back.components) >= {"model", "proposer", "dataset", "logger"}
    # the theory beside the figures (specdec/experiment/theory.py): numbers overall and per category when speculating
    # against an in-run baseline, None for plain decoding
    for s in (back, *back.per_category.values()):
        values = [getattr(s, f) for f in THEORY_FIELDS]
        if experiment == "baseline":
            assert values == [None] * 5 and s.alpha_per_position == []
        else:
            assert all(isinstance(x, float) and x > 0 for x in values), dict(zip(THEORY_FIELDS, values))
            assert s.predicted_tau == pytest.approx(s.mean_acceptance_length, abs=1e-9)  # product form telescopes
            assert len(s.alpha_per_position) == len(back.acceptance_per_position)
    assert (back.baseline_step_time_s.get("step", 0) > 0) == (experiment != "baseline")  # t1, seconds


def test_plain_run_has_tau_one_and_no_speedup(tmp_path):
    summary = run(compose_cfg(["debug=true", f"output_dir={tmp_path}", "dataset.categories=[qa]"]))
    assert summary.mean_acceptance_length == 1.0
    assert summary.acceptance_rate is None and summary.speedup is None and summary.greedy_mismatches is None
    assert summary.requests[0].category == "qa" and summary.requests[0].num_generated_tokens == 8


def test_config_typo_is_a_clear_error():
    with pytest.raises(ValueError, match="max_num_seq"):
        parse_config({"max_num_seq": 3})
    with pytest.raises(ValueError, match="temprature"):
        parse_config({"sampling": {"temprature": 0.5}})
    with pytest.raises(ValueError, match="proposer.num_speculativ_tokens"):
        parse_config({"proposer": {"method": "ngram", "num_speculativ_tokens": 2}})


def test_unknown_category_is_named():
    from specdec.experiment.data import load_spec_bench

    with pytest.raises(ValueError, match="'poetry'"):
        load_spec_bench(["poetry"])
    assert {p.category for p in load_spec_bench("mt_bench", per_category=2)} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_run_takes_a_plain_dict_without_hydra(tmp_path):
    summary = run({"debug": True, "output_dir": str(tmp_path),
                   "proposer": {"method": "ngram", "num_speculative_tokens": 2},
                   "dataset": {"_target_": "specdec.experiment.data.load_spec_bench", "categories": ["qa"]}})
    assert summary.components["proposer"] == "proposers.ngram.NGramProposer"
    assert summary.components["scorer"] == "scorers.mqa.MQAScorer"  # the defaults of the other groups
    assert summary.greedy_mismatches == 0 and summary.per_task["qa"].num_prompts == 1


def test_figures_are_a_ratio_of_means_with_its_interval():
    """tokens/s = total tokens / total seconds; speedup = their ratio (ratio of means) with a bootstrap interval;
    the mean of per-question ratios is kept beside it under its own name."""
    from specdec.experiment.run import _figures
    from specdec.experiment.summary import RequestRecord

    def rec(toks, secs, base_secs):
        return RequestRecord(question_id="q", category="qa", num_prompt_tokens=1, num_generated_tokens=toks,
                             seconds=secs, baseline_seconds=base_secs, baseline_num_generated_tokens=toks,
                             finish_reason="length", text="", greedy_match=True)

    # 20 tokens in 1.25 s (16/s) against 20 in 3.0 s (6.67/s): speedup 2.4; per-question ratios 2 and 4 (mean 3)
    f = _figures([rec(10, 1.0, 2.0), rec(10, 0.25, 1.0)])
    assert (f.tokens, f.tokens_per_s) == (20, 16.0) and f.baseline_tokens_per_s == pytest.approx(20 / 3)
    assert f.speedup == pytest.approx(2.4) and f.speedup_mean_of_ratios == pytest.approx(3.0)
    lo, hi = f.speedup_ci95
    assert 2.0 <= lo <= f.speedup <= hi <= 4.0


def test_second_turn_sees_the_first_answer(tiny_llm):
    from specdec.experiment.data import Prompt
    from specdec.experiment.run import run_prompt
    from specdec.datamodel.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = Prompt(question_id="1", category="writing", turns=["first question", "second question"])
    one = run_prompt(tiny_llm, None, prompt, params, turns=1)
    two = run_prompt(tiny_llm, None, prompt, params, turns=2)
    conv = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": one.text},
            {"role": "user", "content": "second question"}]
    # prompt tokens of turn 2 = the whole conversation so far, first answer included
    assert two.num_prompt_tokens == one.num_prompt_tokens + len(tiny_llm.chat_prompt_ids(conv))
    assert two.num_generated_tokens == 12


def test_latencies_per_request_and_pooled(tiny_llm, tmp_path):
    """TTFT/TPOT/ITL per turn come from the RequestOutput's LatencyStats; the summary pools them (mean,
    p50/p90/p99) and summary.json round-trips them."""
    from specdec.experiment.data import Prompt
    from specdec.experiment.run import run_prompt
    from specdec.datamodel.sampling_params import SamplingParams
    from specdec.experiment.summary import RequestRecord, latency_summary

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    rec = run_prompt(tiny_llm, None, Prompt(question_id="1", category="qa", turns=["a", "b"]), params, turns=2)
    assert len(rec.ttft_s) == 2 and len(rec.tpot_s) == 2 and all(x > 0 for x in rec.ttft_s + rec.tpot_s)
    assert len(rec.itl_s) == 2 * 4  # plain decoding: one emission per token, 4 gaps per 5-token turn

    def r(ttft, tpot, itl):
        return RequestRecord(question_id="q", category="qa", num_prompt_tokens=1, num_generated_tokens=2,
                             seconds=1.0, baseline_seconds=None, finish_reason="length", text="", greedy_match=None,
                             ttft_s=ttft, tpot_s=tpot, itl_s=itl)

    lat = latency_summary([r([1.0], [0.1], [0.1, 0.3]), r([3.0], [], [0.2])])
    assert lat["ttft_mean"] == 2.0 and lat["ttft_p50"] == 2.0 and lat["tpot_mean"] == 0.1
    assert lat["itl_mean"] == pytest.approx(0.2) and lat["itl_p99"] == pytest.approx(0.298)
    assert latency_summary([r([], [], [])]) == {}  # nothing measured: no keys, not NaN


def test_summary_json_has_latencies(tmp_path):
    summary = run(compose_cfg(["debug=true", f"output_dir={tmp_path}", "dataset.categories=[qa]"]))
    back = read_summary(tmp_path / "summary.json")
    assert back.latency == summary.latency and back.requests[0].ttft_s == summary.requests[0].ttft_s
    for name in ("ttft", "tpot", "itl"):
        assert back.latency[f"{name}_mean"] > 0
        assert back.latency[f"{name}_p50"] <= back.latency[f"{name}_p99"]


def test_the_read_rate_is_taken_for_models_whose_weights_stream(tiny_llm, tmp_path):
    """summary.json's read_rate_gbs: W.sum() over the target's weight bytes; none for weights that fit in caches."""
    from types import SimpleNamespace

    from specdec.experiment.run import read_rate

    eng = tiny_llm.engine
    assert read_rate(eng) is None  # a tiny model's weights are far under 64 MB
    assert read_rate(eng, min_bytes=0) > 0
    assert read_rate(SimpleNamespace()) is None  # an engine without a config
    summary = run(compose_cfg(["debug=true", f"output_dir={tmp_path}", "dataset.categories=[qa]"]))
    assert summary.read_rate_gbs == {} and read_summary(tmp_path / "summary.json").read_rate_gbs == {}


def test_a_bad_prompt_file_fails_before_any_model_loads(tmp_path, monkeypatch):
    """The dataset is read before the model: a jsonl row without the field fails at once, naming it."""
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "hello"}\n')
    import specdec.entrypoints.llm as llm_mod

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the prompts were checked")

    monkeypatch.setattr(llm_mod.LLM, "__init__", no_model)
    cfg = compose_cfg(["dataset=jsonl", f"dataset.path={bad}", f"output_dir={tmp_path}"])
    with pytest.raises(KeyError, match=r"has no field 'prompt' \(fields: \['text'\]\); set dataset.field"):
        run(cfg)


def test_proposer_none_in_a_sweep_with_k_is_plain_decoding(tmp_path):
    """-m proposer=none,ngram proposer.num_speculative_tokens=4: the none job decodes plainly (k has no effect)."""
    from specdec.experiment.compose import speculative_config

    rc = parse_config(compose_cfg(["proposer=none", "proposer.num_speculative_tokens=4", "debug=true"]))
    assert speculative_config(rc) is None
    summary = run(compose_cfg(["proposer=none", "proposer.num_speculative_tokens=4", "debug=true",
                               f"output_dir={tmp_path}", "dataset.categories=[qa]"]))
    assert summary.mean_acceptance_length == 1.0 and summary.components["proposer"] == "none (plain decoding)"


def test_batched_run_is_lossless_and_its_seconds_add_up(tmp_path):
    """max_num_seqs=4: the prompts run with continuous batching, plain at the same batch; greedy identical;
    each question's seconds are its share of the steps, so they sum to the measured wall times."""
    summary = run(compose_cfg(["+experiment=ngram", "debug=true", "max_num_seqs=4", f"output_dir={tmp_path}",
                               "dataset.categories=[writing,qa,math,coding,rag]", "sampling.max_tokens=8"]))
    assert summary.num_prompts == 5 and summary.greedy_mismatches == 0
    assert summary.speedup is not None and summary.speedup_ci95 is not None
    assert summary.baseline == {"source": "decoded at batch 4"}
    assert all(r.seconds > 0 and r.baseline_seconds > 0 for r in summary.requests)
    assert summary.mean_acceptance_length >= 1.0 and summary.acceptance_rate is not None
    assert sum(r.num_draft_tokens for r in summary.requests) > 0


def test_a_setting_without_effect_is_refused():
    with pytest.raises(ValueError, match="baseline='fresh' has no effect with measure_baseline=false"):
        parse_config({"measure_baseline": False, "baseline": "fresh"})
    with pytest.raises(ValueError, match="no effect at max_num_seqs=4"):
        parse_config({"max_num_seqs": 4, "baseline": "/some/run"})


def test_num_threads_null_is_the_process_default_in_every_job(tmp_path):
    """torch.set_num_threads persists in a process: a sweep job of num_threads=null ran with the previous job's
    count (hydra/launcher=basic)."""
    import torch

    from specdec.experiment.run import _PROCESS_THREADS

    cfg = {"debug": True, "proposer": {"method": "ngram", "num_speculative_tokens": 2},
           "dataset": {"_target_": "specdec.experiment.data.load_spec_bench", "categories": ["qa"]}}
    try:
        run({**cfg, "output_dir": str(tmp_path / "a"), "num_threads": 1})
        assert torch.get_num_threads() == 1
        run({**cfg, "output_dir": str(tmp_path / "b"), "num_threads": None})
        assert torch.get_num_threads() == _PROCESS_THREADS
    finally:
        torch.set_num_threads(_PROCESS_THREADS)


def test_the_default_run_is_the_flagship(tmp_path):
    """`python -m specdec.run` with no experiment or proposer named speculates (+experiment=eagle) beside its plain
    baseline; naming an experiment or a proposer keeps conf/config.yaml's plain defaults underneath."""
    import subprocess
    import sys

    from specdec.experiment.compose import flagship

    assert flagship([]) == ["+experiment=eagle"]
    assert flagship(["debug=true", "-m"]) == ["+experiment=eagle", "debug=true", "-m"]
    assert flagship(["--cfg", "job"]) == ["+experiment=eagle", "--cfg", "job"]
    for named in (["+experiment=ngram"], ["experiment=ngram"], ["proposer=none"], ["proposer.method=bigram"],
                  ["proposer._target_=my.Proposer"], ["proposer=ngram", "proposer.num_speculative_tokens=4"]):
        assert flagship(named) == named
    # a proposer key that names no proposer tunes the flagship (it used to run plain decoding, the key ignored)
    for tune in (["proposer.speculation_policy=static"], ["++proposer.policy_options.prior=0.6"],
                 ["+proposer.options.ngram_branch=3"], ["scorer.tree_budget=8"]):
        assert flagship(tune) == ["+experiment=eagle", *tune]
    done = subprocess.run([sys.executable, "-m", "specdec.run", "debug=true", "dataset.per_category=1",
                           f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "running the flagship, +experiment=eagle" in done.stderr
    summary = read_summary(done.stdout.strip().splitlines()[-1])
    assert summary.components["proposer"] == "proposers.eagle3.Eagle3Proposer"
    assert summary.components["scorer"] == "scorers.tree.TreeScorer"
    assert summary.speedup is not None and summary.greedy_mismatches == 0


def test_multi_step_run_is_lossless(tmp_path, monkeypatch):
    """num_scheduler_steps=4 reaches the LLM (and its in-run plain baseline); greedy tokens still equal plain's."""
    from specdec.core.llm_engine import LLMEngine

    seen = []
    init = LLMEngine.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("num_scheduler_steps"))
        init(self, *a, **kw)

    monkeypatch.setattr(LLMEngine, "__init__", spy)
    summary = run(compose_cfg(["+experiment=ngram", "debug=true", "num_scheduler_steps=4", f"output_dir={tmp_path}",
                               "dataset.categories=[writing,qa]", "sampling.max_tokens=8"]))
    assert seen and set(seen) == {4}
    assert summary.greedy_mismatches == 0 and summary.speedup is not None
