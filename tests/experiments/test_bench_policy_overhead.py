"""experiments/bench/policy_overhead.py on the tiny model: both parts run, the phases are timed, and every config of
the saturated part emits plain decoding's tokens. Figures for experiments/LOG.md come from SmolLM2, not from here."""

from experiments.bench.policy_overhead import PHASES, PhaseTimer, main


def test_the_bench_runs_and_never_changes_the_tokens(capsys):
    res = main(["--model", "tiny-random-llama", "--batches", "1,3", "--tokens", "8", "--saturate", "5", "--reps", "2",
                "--threads", "1"])
    text = capsys.readouterr().out
    assert "batch 1: worst" in text and "batch 3: worst" in text and "| never |" in text
    assert len(res["overhead"][1]) == 13 and list(res["overhead"][3]) == ["3 prompts"]  # a row per category at 1
    for B in (1, 3):
        for r in res["overhead"][B].values():
            assert r["decode_steps"] > 0 and r["policy_ms_per_step"] > 0 and r["forward_ms"] > 0
            assert r["share_pct"] == r["policy_ms_per_step"] / r["forward_ms"] * 100
    assert set(res["saturated"]) == {"plain", "never", "goodput"}
    assert all(r["same_tokens"] for rs in res["saturated"].values() for r in rs if r["same_tokens"] is not None)
    assert sum(r["same_tokens"] is not None for rs in res["saturated"].values() for r in rs) >= 5


def test_the_never_policy_does_the_work_and_drafts_nothing():
    from experiments.bench.policy_overhead import never_drafting, overhead
    from specdec import LLM
    from specdec.spec_decode.policy import GoodputPolicy

    base = LLM("tiny-random-llama", max_num_seqs=2, max_model_len=256)
    llm = base.with_speculation({"method": "ngram", "num_speculative_tokens": 3, "speculation_policy": "goodput"})
    never_drafting(llm)
    assert isinstance(llm.worker.policy, GoodputPolicy)
    r = overhead(llm, [[1, 2, 3, 1, 2, 3, 1, 2]] * 2, 8)
    assert r["plain_steps"] == r["decode_steps"] > 0 and r["policy_ms_per_step"] > 0


def test_the_timer_restores_the_worker_and_the_policy():
    from specdec.spec_decode.policy import GoodputPolicy
    from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker

    owner = {n: GoodputPolicy if n == "reuses_zeros" else SpecDecodeWorker for n in PHASES}
    before = {n: getattr(owner[n], n) for n in PHASES}
    with PhaseTimer():
        assert all(getattr(owner[n], n) is not before[n] for n in PHASES)
    assert all(getattr(owner[n], n) is before[n] for n in PHASES)
